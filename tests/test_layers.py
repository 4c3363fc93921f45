"""The layer rules (docs/engine.md): the engine core knows the step and its runner, not the
model, the kernels or the planner; model and engine code reaches no Triton launch
internals; only the attention calls the planner; the capture mode is an argument."""

from __future__ import annotations

from pathlib import Path

from test_structure import _imports

PACKAGE = Path(__file__).resolve().parents[1] / "deft"


def _under(names: set[str], *prefixes: str) -> set[str]:
    return {n for n in names if any(n == p or n.startswith(p + ".") for p in prefixes)}


def test_imports_are_resolved_against_the_package():
    assert "deft.engine.runner.ModelRunner" in _imports(PACKAGE / "engine" / "core.py")
    assert "deft.ops.triton.launch" in _imports(PACKAGE / "ops" / "triton" / "backend.py")


def test_the_engine_core_imports_no_model_ops_plan_or_graphs():
    got = _imports(PACKAGE / "engine" / "core.py")
    assert _under(got, "deft.model", "deft.ops", "deft.plan", "deft.engine.graphs") == set()


def test_model_and_engine_reach_no_triton_launch_internals():
    bad = {str(p.relative_to(PACKAGE)): sorted(_under(_imports(p), "deft.ops.triton"))
           for folder in ("model", "engine") for p in (PACKAGE / folder).rglob("*.py")}
    assert {k: v for k, v in bad.items() if v} == {}


def test_only_the_attention_and_backends_call_the_planner():
    allowed = ("attention.py", "__init__.py", "ops/", "plan/")
    users = sorted(str(p.relative_to(PACKAGE)) for p in PACKAGE.rglob("*.py")
                   if _under(_imports(p), "deft.plan.make_plan", "deft.plan.plan_step",
                             "deft.plan.tree_plan", "deft.plan.flatten_plan")
                   and not str(p.relative_to(PACKAGE)).startswith(allowed))
    assert users == []


def test_no_thread_local_capture_mode():
    text = (PACKAGE / "ops" / "triton" / "launch.py").read_text()
    assert "threading" not in text and "launch_as_captured" not in text
