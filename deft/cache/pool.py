"""Per-layer paged K/V tensors: the memory a tree cache hands out page by page, and how many
pages a memory budget holds."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import torch

from ..checks import positive_int

__all__ = ["CALIBRATION_HEADROOM", "FP8", "KV_DTYPE_NAMES", "KV_MEMORY_FRACTION",
           "KV_SCALE_MODES", "KVPool", "KVSpec", "default_kv_budget", "free_memory",
           "page_bytes"]

KV_SCALE_MODES = ("none", "per_layer", "per_head")
FP8 = torch.float8_e4m3fn
# The names of K/V formats the commands take (``--kv-dtype``); ``"auto"``: the model's dtype.
KV_DTYPE_NAMES = ("auto", "fp8_e4m3")
# A calibrated scale maps this many times the calibration's largest magnitude to the
# format's largest value: later tokens may be larger (they saturate beyond it). e4m3 keeps
# its 3-bit relative precision over 2^15 of range, so the headroom costs little.
CALIBRATION_HEADROOM = 2.0

# The default K/V budget is this fraction of the memory still free once the model is loaded;
# the rest is left to activations, the logits and everything else in the process.
KV_MEMORY_FRACTION = 0.5
_FALLBACK_FREE = 1 << 31  # CPU bytes assumed free where the system says nothing
_UNLIMITED = 1 << 60  # cgroup limits at or above this are "no limit"
# (limit file, usage file) of the process's memory cgroup, v2 then v1, as a container sees them.
_CGROUP_FILES = (
    ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),
    ("/sys/fs/cgroup/memory/memory.limit_in_bytes", "/sys/fs/cgroup/memory/memory.usage_in_bytes"),
)


def page_bytes(num_layers: int, page_size: int, num_kv_heads: int, head_dim: int,
               dtype: torch.dtype = torch.float32) -> int:
    """Bytes of one page of K and V in every layer."""
    elem = torch.empty((), dtype=dtype).element_size()
    return 2 * num_layers * page_size * num_kv_heads * head_dim * elem


def free_memory(device: str | torch.device = "cpu") -> int:
    """Bytes this process can still allocate on ``device``.

    CUDA: the device's free memory. CPU: the least of the available RAM (``MemAvailable``),
    what the memory cgroup (a container's limit) leaves and what the address-space and data
    limits (``ulimit -v``, ``RLIMIT_AS``/``RLIMIT_DATA``) leave; 2 GiB where none is known.
    """
    device = torch.device(device)
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    known = [n for n in (_meminfo_available(), _cgroup_free(), *_rlimit_free()) if n is not None]
    return max(0, min(known)) if known else _FALLBACK_FREE


def default_kv_budget(device: str | torch.device = "cpu") -> int:
    """The K/V budget when none is given: :data:`KV_MEMORY_FRACTION` of :func:`free_memory`."""
    return int(KV_MEMORY_FRACTION * free_memory(device))


def _meminfo_available() -> int | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, AttributeError):
        return None


def _cgroup_free() -> int | None:
    for limit_file, usage_file in _CGROUP_FILES:
        try:
            limit = Path(limit_file).read_text().strip()
            if limit == "max" or int(limit) >= _UNLIMITED:
                return None
            return int(limit) - int(Path(usage_file).read_text())
        except (OSError, ValueError):
            continue
    return None


def _rlimit_free() -> list[int | None]:
    """Room left under ``RLIMIT_AS`` (against VmSize) and ``RLIMIT_DATA`` (against VmData)."""
    try:
        import resource

        with open("/proc/self/status") as f:
            status = dict(line.split(":", 1) for line in f if ":" in line)
    except (ImportError, OSError):
        return []
    out: list[int | None] = []
    for limit, field in ((resource.RLIMIT_AS, "VmSize"), (resource.RLIMIT_DATA, "VmData")):
        soft = resource.getrlimit(limit)[0]
        if soft == resource.RLIM_INFINITY or field not in status:
            continue
        try:
            out.append(soft - int(status[field].split()[0]) * 1024)
        except ValueError:
            continue
    return out


@dataclass(frozen=True)
class KVSpec:
    """How K and V are stored: ``dtype``, and ``scale``, the dequantisation scales'
    granularity: ``"none"`` (K/V are the values themselves), ``"per_layer"`` (one K and one
    V scale per layer) or ``"per_head"`` (one per layer and KV head): the values are
    ``k * k_scale``, ``v * v_scale``; attention backends with ``kv_scales`` read them.
    ``float8_e4m3fn`` (:data:`FP8`) needs scales."""

    dtype: torch.dtype = torch.float32
    scale: str = "none"

    def __post_init__(self) -> None:
        if not isinstance(self.dtype, torch.dtype) or not self.dtype.is_floating_point:
            raise TypeError(f"dtype: expected a floating-point torch dtype for K/V, got "
                            f"{self.dtype!r}")
        if self.scale not in KV_SCALE_MODES:
            raise ValueError(f"scale: expected one of {', '.join(KV_SCALE_MODES)}, got "
                             f"{self.scale!r}")
        if self.dtype == FP8 and self.scale == "none":
            raise ValueError("scale: an FP8 K/V format needs scales, expected per_layer or "
                             "per_head, got 'none'")

    @classmethod
    def named(cls, name: str) -> KVSpec | None:
        """The format of a ``--kv-dtype`` name (:data:`KV_DTYPE_NAMES`): ``None`` for
        ``"auto"`` (the model's dtype, unscaled), ``KVSpec(FP8, "per_head")`` for
        ``"fp8_e4m3"``."""
        if name == "auto":
            return None
        if name == "fp8_e4m3":
            return cls(FP8, "per_head")
        raise ValueError(f"kv_dtype: expected one of {', '.join(KV_DTYPE_NAMES)}, got {name!r}")

    @property
    def scaled(self) -> bool:
        return self.scale != "none"


class KVPool:
    """K and V pools of every layer, each ``[num_pages, page_size, num_kv_heads, head_dim]``,
    stored as ``spec`` says (:class:`KVSpec`; ``dtype`` alone gives an unscaled spec).

    Slot ``s`` is row ``s`` of ``k_slots[layer]``, the ``[num_slots, num_kv_heads, head_dim]``
    view of ``k[layer]`` (page ``s // page_size``, offset ``s % page_size``; the views are
    made once: a view costs microseconds of host time, and layers take them every step). The
    pool holds tensors only; which slots are in use is the cache's bookkeeping.

    A scaled spec adds the static dequantisation scales ``k_scale``/``v_scale``, float32
    ``[num_layers, 1]`` (``per_layer``) or ``[num_layers, num_kv_heads]`` (``per_head``),
    at fixed addresses (CUDA graphs read them there); ``scales(layer)`` returns a layer's
    pair as views. They are given (:meth:`set_scales`) or calibrated: a layer's first
    :meth:`write` before any is given sets them from the K/V it writes (the engine's first
    step: the first prompt's first chunk), the largest magnitude of each head times
    :data:`CALIBRATION_HEADROOM` mapping to the format's largest value. ``calibrated`` says
    whether every layer has its scales.
    """

    def __init__(
        self,
        num_layers: int,
        num_pages: int,
        page_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype = torch.float32,
        device: str | torch.device = "cpu",
        spec: KVSpec | None = None,
    ) -> None:
        num_layers, num_pages = positive_int(num_layers, "num_layers"), positive_int(num_pages, "num_pages")
        page_size = positive_int(page_size, "page_size")
        num_kv_heads, head_dim = positive_int(num_kv_heads, "num_kv_heads"), positive_int(head_dim, "head_dim")
        self.num_layers, self.num_pages, self.page_size = num_layers, num_pages, page_size
        self.num_kv_heads, self.head_dim = num_kv_heads, head_dim
        if spec is None:
            spec = KVSpec(dtype)
        elif not isinstance(spec, KVSpec):
            raise TypeError(f"spec: expected a deft.cache.KVSpec, got {type(spec).__name__}")
        self.spec = spec
        dtype = spec.dtype
        shape = (num_pages, page_size, num_kv_heads, head_dim)
        # Not zero-filled: a slot is written before any query sees it, and attention never lets
        # rows a query cannot see into its arithmetic; untouched host pages cost no memory.
        self.k = [torch.empty(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v = [torch.empty(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.k_slots = [t.view(-1, num_kv_heads, head_dim) for t in self.k]
        self.v_slots = [t.view(-1, num_kv_heads, head_dim) for t in self.v]
        # FP8 rows are written and copied as bytes (indexing of every device takes those).
        self._raw = dtype == FP8
        self._k_rows = [_raw(t, self._raw) for t in self.k_slots]
        self._v_rows = [_raw(t, self._raw) for t in self.v_slots]
        self.k_scale = self.v_scale = None
        self._scales: list[tuple[torch.Tensor | None, torch.Tensor | None]] = [(None, None)] * num_layers
        self._uncalibrated: set[int] = set()
        if spec.scaled:
            width = num_kv_heads if spec.scale == "per_head" else 1
            self.k_scale = torch.ones(num_layers, width, dtype=torch.float32, device=device)
            self.v_scale = torch.ones(num_layers, width, dtype=torch.float32, device=device)
            self._scales = [(self.k_scale[i], self.v_scale[i]) for i in range(num_layers)]
            self._uncalibrated = set(range(num_layers))

    @property
    def num_slots(self) -> int:
        return self.num_pages * self.page_size

    @property
    def dtype(self) -> torch.dtype:
        return self.spec.dtype

    @property
    def calibrated(self) -> bool:
        """Every layer has its scales (always, for an unscaled spec)."""
        return not self._uncalibrated

    def scales(self, layer: int) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """``(k_scale, v_scale)`` of ``layer``: float32 views ``[1]`` or ``[num_kv_heads]``,
        or ``None`` each for an unscaled spec."""
        return self._scales[layer]

    def set_scales(self, k_scale: torch.Tensor | float, v_scale: torch.Tensor | float) -> None:
        """Give every layer's scales (positive and finite; anything that broadcasts to
        ``k_scale``'s shape), written in place: no calibration then."""
        if self.k_scale is None:
            raise ValueError(f"k_scale: the pool's format {self.spec} is unscaled; expected a "
                             "scaled KVSpec")
        for name, given, dst in (("k_scale", k_scale, self.k_scale),
                                 ("v_scale", v_scale, self.v_scale)):
            t = torch.as_tensor(given, dtype=torch.float32)
            try:
                t = torch.broadcast_to(t, dst.shape)
            except RuntimeError:
                raise ValueError(f"{name}: expected a shape that broadcasts to "
                                 f"{tuple(dst.shape)}, got {tuple(t.shape)}") from None
            if not bool(((t > 0) & torch.isfinite(t)).all()):
                raise ValueError(f"{name}: expected positive finite scales")
            dst.copy_(t)
        self._uncalibrated.clear()

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store ``k, v [N, num_kv_heads, head_dim]`` at ``slots [N]`` of ``layer``; under a
        scaled spec, :func:`quantize` them by the layer's scales (calibrated first if the
        layer has none)."""
        k_scale, v_scale = self._scales[layer]
        if k_scale is not None:
            if layer in self._uncalibrated and k.shape[0]:
                k_scale.copy_(_calibrate(k, k_scale.shape[0], self.spec.dtype))
                v_scale.copy_(_calibrate(v, v_scale.shape[0], self.spec.dtype))
                self._uncalibrated.discard(layer)
            k, v = quantize(k, k_scale, self.spec.dtype), quantize(v, v_scale, self.spec.dtype)
        raw, dtype = self._raw, self.spec.dtype
        self._k_rows[layer][slots] = _raw(k.to(dtype), raw)
        self._v_rows[layer][slots] = _raw(v.to(dtype), raw)

    def copy_slots(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Copy K/V rows ``src [N]`` to ``dst [N]`` in every layer (e.g. a partly filled page)."""
        for flat in (*self._k_rows, *self._v_rows):
            flat[dst] = flat[src]


def quantize(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``x [N, H_kv, D] / scale [1 or H_kv]`` in ``dtype``: finite values rounded to nearest
    and saturated at ``dtype``'s largest magnitude, non-finite ones NaN (e4m3 has no inf, so
    a non-finite K/V value stays non-finite, and attention isolates it)."""
    top = torch.finfo(dtype).max
    y = (x.float() / scale[:, None]).clamp(-top, top)
    return torch.where(torch.isfinite(x), y, float("nan")).to(dtype)


def _calibrate(x: torch.Tensor, width: int, dtype: torch.dtype) -> torch.Tensor:
    """Scales ``[width]`` (1: one for all heads) that map :data:`CALIBRATION_HEADROOM` times
    the largest finite magnitude of ``x [N, H_kv, D]`` (per head) to ``dtype``'s largest
    value; 1 where ``x`` holds none but zeros. On the device, without synchronising."""
    a = torch.where(torch.isfinite(x), x.float().abs(), 0.0)
    amax = a.amax(dim=(0, 2)) if width > 1 else a.amax().reshape(1)
    scale = amax * (CALIBRATION_HEADROOM / torch.finfo(dtype).max)
    return torch.where(scale > 0, scale, 1.0)


def _raw(t: torch.Tensor, raw: bool) -> torch.Tensor:
    """``t`` viewed as its bytes if ``raw``, else ``t``."""
    return t.view(torch.uint8) if raw else t
