"""Builds the compiled planner (``deft.plan._flatten_plan``) and the driver-launch helper
(``deft.ops.triton._driver_launch``) at install; metadata is in pyproject.toml. Without a
working C compiler or the Python headers the package still installs, after a warning, and
plans with numpy (and launches one kernel per ctypes call)."""

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext


class OptionalBuildExt(build_ext):
    """``build_ext`` whose failure is a warning, not a failed install."""

    def run(self) -> None:
        try:
            super().run()
        except Exception as exc:  # noqa: BLE001 - no compiler at all (distutils errors vary)
            self._skip(exc)

    def build_extension(self, ext: Extension) -> None:
        try:
            super().build_extension(ext)
        except Exception as exc:  # noqa: BLE001 - compile or link errors
            self._skip(exc)

    def _skip(self, exc: Exception) -> None:
        self.warn(f"deft: a compiled helper was not built ({exc}); deft will plan with "
                  f"numpy and launch through ctypes (slower). Install a C compiler and the "
                  f"Python headers (python3-dev on Debian) and reinstall to build it.")


setup(
    ext_modules=[Extension("deft.plan._flatten_plan", ["deft/plan/flatten_plan.c"],
                           # included by flatten_plan.c
                           depends=["deft/plan/tile_masks.c", "deft/plan/launch_model.c"],
                           extra_compile_args=["-O3", "-std=c11"], libraries=["m"]),
                 Extension("deft.ops.triton._driver_launch", ["deft/ops/triton/driver_launch.c"],
                           extra_compile_args=["-O3", "-std=c11"])],
    cmdclass={"build_ext": OptionalBuildExt},
)
