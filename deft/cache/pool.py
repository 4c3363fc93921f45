"""Per-layer paged K/V tensors: the memory a tree cache hands out page by page, and how many
pages a memory budget holds."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import torch

from ..checks import positive_int

__all__ = ["KV_MEMORY_FRACTION", "KV_SCALE_MODES", "KVPool", "KVSpec", "default_kv_budget",
           "free_memory", "page_bytes"]

KV_SCALE_MODES = ("none", "per_layer")

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
    granularity: ``"none"`` (K/V are the values themselves) or ``"per_layer"`` (one K and
    one V scale per layer: the values are ``k * k_scale``, ``v * v_scale``; attention
    backends with ``kv_scales`` read them)."""

    dtype: torch.dtype = torch.float32
    scale: str = "none"

    def __post_init__(self) -> None:
        if not isinstance(self.dtype, torch.dtype) or not self.dtype.is_floating_point:
            raise TypeError(f"dtype: expected a floating-point torch dtype for K/V, got "
                            f"{self.dtype!r}")
        if self.scale not in KV_SCALE_MODES:
            raise ValueError(f"scale: expected one of {', '.join(KV_SCALE_MODES)}, got "
                             f"{self.scale!r}")

    @property
    def scaled(self) -> bool:
        return self.scale != "none"


class KVPool:
    """K and V pools of every layer, each ``[num_pages, page_size, num_kv_heads, head_dim]``,
    stored as ``spec`` says (:class:`KVSpec`; ``dtype`` alone gives an unscaled spec).

    Slot ``s`` is row ``s`` of ``k_slots[layer]``, the ``[num_slots, num_kv_heads, head_dim]``
    view of ``k[layer]`` (page ``s // page_size``, offset ``s % page_size``; the views are
    made once: a view costs microseconds of host time, and layers take them every step). The
    pool holds tensors only; which slots are in use is the cache's bookkeeping. A scaled
    spec adds ``k_scale``/``v_scale`` (float32 ``[num_layers]``, ones at first; set them
    before writing) and ``scales(layer)`` returns a layer's pair as one-element views.
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
        self.k_scale = self.v_scale = None
        self._scales: list[tuple[torch.Tensor | None, torch.Tensor | None]] = [(None, None)] * num_layers
        if spec.scaled:
            self.k_scale = torch.ones(num_layers, dtype=torch.float32, device=device)
            self.v_scale = torch.ones(num_layers, dtype=torch.float32, device=device)
            self._scales = [(self.k_scale[i:i + 1], self.v_scale[i:i + 1]) for i in range(num_layers)]

    @property
    def num_slots(self) -> int:
        return self.num_pages * self.page_size

    @property
    def dtype(self) -> torch.dtype:
        return self.spec.dtype

    def scales(self, layer: int) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """``(k_scale, v_scale)`` of ``layer``: one-element float32 views, or ``None`` each
        for an unscaled spec."""
        return self._scales[layer]

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store ``k, v [N, num_kv_heads, head_dim]`` at ``slots [N]`` of ``layer`` (divided
        by the layer's scales under a scaled spec)."""
        k_scale, v_scale = self._scales[layer]
        if k_scale is not None:
            k, v = k.float() / k_scale, v.float() / v_scale
        self.k_slots[layer][slots] = k.to(self.spec.dtype)
        self.v_slots[layer][slots] = v.to(self.spec.dtype)

    def copy_slots(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Copy K/V rows ``src [N]`` to ``dst [N]`` in every layer (e.g. a partly filled page)."""
        for flat in (*self.k_slots, *self.v_slots):
            flat[dst] = flat[src]
