"""Which slice of each weight a tensor-parallel rank holds (Megatron's layout).

q/k/v and gate/up are column-parallel (each rank holds the output rows of its heads and of
its part of the MLP), o and down row-parallel (the matching input columns; their partial
products are summed by one all-reduce each per layer, and their biases live on rank 0 only);
embedding, norms and LM head are replicated, so every rank's logits are the whole
vocabulary's. Query heads go with their KV head: ranks split the KV heads (unevenly when
they do not divide, e.g. SmolLM2's 3 over 2 ranks), or, with fewer KV heads than ranks,
each KV head is replicated on ``world_size / num_kv_heads`` ranks that split its query
heads.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Mapping

import torch

from ..checks import int_in_range, positive_int
from .config import LlamaConfig
from .llama import LlamaModel, build_model, fuse_hf_weights

__all__ = ["LazyTensors", "ShardedTensors", "TPShard", "attach", "build_hf", "hf_slice",
           "shard_config", "shard_model", "shard_state"]

Span = tuple[int, int]  # [start, stop)


@dataclass(frozen=True)
class TPShard:
    """Rank ``rank``'s part of a model of ``full`` config: query heads ``heads``, KV heads
    ``kv_heads``, MLP rows ``ffn``; ``config`` is the rank's own (fewer heads, a narrower MLP)."""

    rank: int
    world_size: int
    full: LlamaConfig
    heads: Span
    kv_heads: Span
    ffn: Span
    config: LlamaConfig

    def rows(self, kind: str) -> Span:
        """Rows of the full q (``"q"``), k or v (``"kv"``) or gate/up (``"ffn"``) projection."""
        d = self.full.head_dim
        lo, hi = {"q": self.heads, "kv": self.kv_heads, "ffn": self.ffn}[kind]
        return (lo, hi) if kind == "ffn" else (lo * d, hi * d)


def _even(n: int, parts: int, i: int) -> Span:
    return n * i // parts, n * (i + 1) // parts


def shard_config(config: LlamaConfig, world_size: int, rank: int) -> TPShard:
    """Rank ``rank``'s :class:`TPShard` of ``config`` among ``world_size`` ranks; a
    ``ValueError`` saying why when the heads cannot be split."""
    world_size = positive_int(world_size, "tensor_parallel_size")
    rank = int_in_range(rank, "rank", 0, world_size - 1)
    c = config
    group = c.num_heads // c.num_kv_heads  # query heads per KV head
    if c.num_kv_heads >= world_size:
        kv = _even(c.num_kv_heads, world_size, rank)
        heads = (kv[0] * group, kv[1] * group)
    else:
        copies = world_size // c.num_kv_heads
        if world_size % c.num_kv_heads or group % copies:
            raise ValueError(
                f"tensor_parallel_size: {world_size} ranks cannot split {c.num_heads} query heads "
                f"over {c.num_kv_heads} KV heads (with fewer KV heads than ranks, each KV head is "
                f"replicated on world_size / num_kv_heads ranks that split its {group} query "
                f"heads: use a size dividing {c.num_kv_heads}, or a multiple of it that divides "
                f"{c.num_heads})")
        kv_head, part = divmod(rank, copies)
        kv = (kv_head, kv_head + 1)
        lo = kv_head * group + part * group // copies
        heads = (lo, lo + group // copies)
    if c.intermediate_size < world_size:
        raise ValueError(f"tensor_parallel_size: {world_size} ranks, more than the MLP's "
                         f"{c.intermediate_size} rows")
    ffn = _even(c.intermediate_size, world_size, rank)
    local = dataclasses.replace(c, num_heads=heads[1] - heads[0], num_kv_heads=kv[1] - kv[0],
                                intermediate_size=ffn[1] - ffn[0], head_dim=c.head_dim)
    return TPShard(rank, world_size, c, heads, kv, ffn, local)


# Hugging Face projection name -> (parallel kind, the rows it splits)
_HF = {"q_proj": ("column", "q"), "k_proj": ("column", "kv"), "v_proj": ("column", "kv"),
       "gate_proj": ("column", "ffn"), "up_proj": ("column", "ffn"),
       "o_proj": ("row", "q"), "down_proj": ("row", "ffn")}


def hf_slice(name: str, shard: TPShard) -> tuple[str, int, Span] | None:
    """How ``shard`` holds the Hugging Face tensor ``name``: ``("split", dim, span)``,
    ``("first", 0, (0, 0))`` (rank 0 only: a row-parallel bias), or ``None`` (whole)."""
    parts = name.split(".")
    rule = _HF.get(parts[-2]) if len(parts) >= 2 else None
    if rule is None:
        return None
    kind, rows = rule
    if kind == "column":
        return "split", 0, shard.rows(rows)
    if parts[-1] == "bias":
        return "first", 0, (0, 0)
    return "split", 1, shard.rows(rows)


def _take(t: torch.Tensor, how: tuple[str, int, Span] | None, rank: int) -> torch.Tensor:
    if how is None:
        return t
    kind, dim, (lo, hi) = how
    if kind == "first":
        return t if rank == 0 else torch.zeros_like(t)
    return t.narrow(dim, lo, hi - lo).clone()


class LazyTensors(Mapping[str, torch.Tensor]):
    """A mapping of tensor names whose tensors are made or read when asked for: membership,
    iteration and length come from ``index`` (keyed by the names), never from a read."""

    def __init__(self, index: Mapping[str, Any]) -> None:
        self._index = index

    def __contains__(self, name: object) -> bool:
        return name in self._index

    def __iter__(self) -> Iterator[str]:
        return iter(self._index)

    def __len__(self) -> int:
        return len(self._index)


class ShardedTensors(LazyTensors):
    """Hugging Face-named tensors as one rank holds them (a view of ``tensors``: each
    tensor is sliced when read). ``read_slice(name, dim, start, stop)``, when given, reads
    only a slice from storage (e.g. safetensors' ``get_slice``), so a rank never loads the
    rows it does not hold."""

    def __init__(self, tensors: Mapping[str, torch.Tensor], shard: TPShard,
                 read_slice: Callable[[str, int, int, int], torch.Tensor] | None = None) -> None:
        super().__init__(tensors)
        self.tensors, self.shard, self.read_slice = tensors, shard, read_slice

    def __getitem__(self, name: str) -> torch.Tensor:
        how = hf_slice(name, self.shard)
        if how is not None and how[0] == "split" and self.read_slice is not None:
            return self.read_slice(name, how[1], *how[2])
        return _take(self.tensors[name], how, self.shard.rank)


def shard_state(state: Mapping[str, torch.Tensor], shard: TPShard) -> dict[str, torch.Tensor]:
    """A :class:`~deft.model.LlamaModel` state (our fused names, of ``shard.full``) cut to
    ``shard`` (of ``shard.config``): for models built in memory, e.g. random weights."""
    c = shard.full
    q_rows, kv_rows = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    out: dict[str, torch.Tensor] = {}
    for name, t in state.items():
        module, _, suffix = name.rpartition(".")
        kind = module.rsplit(".", 1)[-1]
        if kind == "qkv":
            spans = [shard.rows("q"), shard.rows("kv"), shard.rows("kv")]
            offsets = [0, q_rows, q_rows + kv_rows]
        elif kind == "gate_up":
            spans, offsets = [shard.rows("ffn")] * 2, [0, c.intermediate_size]
        elif kind in ("o", "down"):
            how = (("first", 0, (0, 0)) if suffix == "bias"
                   else ("split", 1, shard.rows("q" if kind == "o" else "ffn")))
            out[name] = _take(t, how, shard.rank)
            continue
        else:
            out[name] = t
            continue
        out[name] = torch.cat([t[off + lo:off + hi] for off, (lo, hi) in zip(offsets, spans)])
    return out


def attach(model: LlamaModel, tp: Any) -> LlamaModel:
    """Mark ``model`` (built from a :class:`TPShard`'s config) as ``tp``'s rank's shard: its
    layers sum the row-parallel outputs with ``tp.all_reduce``."""
    model.tp = tp
    for layer in model.layers:
        layer.all_reduce = tp.all_reduce
    return model


def shard_model(model: LlamaModel, tp: Any) -> LlamaModel:
    """This rank's shard of ``model`` (the whole model, e.g. random weights built in memory
    from the same seed on every rank) as a new model on the same device and dtype."""
    shard = shard_config(model.config, tp.world_size, tp.rank)
    state = shard_state(model.state_dict(), shard)
    return attach(build_model(shard.config, state, dtype=model.dtype, device=model.device), tp)


def build_hf(config: LlamaConfig, tensors: Mapping[str, torch.Tensor], source: str,
             dtype: torch.dtype, device: str | torch.device, tp: Any = None,
             read_slice: Callable[[str, int, int, int], torch.Tensor] | None = None) -> LlamaModel:
    """The model of the Hugging Face-named ``tensors``: whole, or with ``tp`` (a
    :class:`~deft.distributed.TPGroup`) its rank's shard, read through ``read_slice`` when
    given. Errors name ``source``."""
    if tp is None:
        return build_model(config, fuse_hf_weights(config, tensors, source), dtype, device)
    try:
        shard = shard_config(config, tp.world_size, tp.rank)
    except ValueError as exc:
        raise ValueError(f"{source}: {exc}") from None
    state = fuse_hf_weights(shard.config, ShardedTensors(tensors, shard, read_slice), source)
    return attach(build_model(shard.config, state, dtype, device), tp)
