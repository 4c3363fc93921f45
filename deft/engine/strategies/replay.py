"""Replay a recorded reasoning tree (Graph-of-Thoughts template) through the engine.

The recorded files (``deft/reasoning/*.json`` under the workloads directory, see
``deft.recorded.workloads_dir``) give, per thought, the iterations during which it is
decoded and the thoughts that branch from it when it ends. Replaying one record
reproduces the *shape* of that run: node 0's prompt is prefilled (random token ids of
the recorded length), then each iteration every active thought decodes one token in a
single forward, a thought that ends with children forks them (sharing its K/V), and a
thought that ends without children is pruned with every ancestor no one else needs.
The tokens themselves are random or greedy: this measures speed and memory traffic,
not text.
"""

from __future__ import annotations

import json
import os
import time
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch

from ...checks import int_at_least, is_int
from ...recorded import load_reasoning_records
from ..core import TreeEngine
from ..decoding import prefill, release_on_error

__all__ = ["ReplayReport", "load_trace", "replay_trace"]

TOKEN_MODES = ("random", "greedy")


@dataclass(frozen=True)
class ReplayReport:
    """What a replay did and measured.

    ``decode_tokens`` over ``decode_s`` (the iterations after the prefill, without the
    I/O bookkeeping) gives ``tokens_per_s``. ``kv_bytes_deft`` / ``kv_bytes_per_branch``:
    K/V bytes all layers read over the whole replay under DeFT's plan and under
    per-branch decoding (every query reads its whole path), as
    ``deft.make_plan(...).io_bytes`` counts them.
    """

    trace: str
    record: int
    iterations: int
    prompt_tokens: int
    thoughts: int
    max_active: int
    decode_tokens: int
    prefill_s: float
    decode_s: float
    kv_bytes_deft: int
    kv_bytes_per_branch: int
    peak_pages: int

    @property
    def tokens_per_s(self) -> float:
        return self.decode_tokens / self.decode_s if self.decode_s > 0 else float("nan")

    @property
    def kv_ratio(self) -> float:
        """How many times more K/V per-branch decoding reads than DeFT."""
        return self.kv_bytes_per_branch / self.kv_bytes_deft if self.kv_bytes_deft else float("nan")


def load_trace(path: str | os.PathLike[str], record: int = 0) -> dict[int, dict[str, Any]]:
    """Thought ``id -> {value, start, end, children}`` of complete record ``record`` of ``path``.

    ``ValueError`` names the first rule the record breaks (see :func:`_check_thoughts`), so
    that a replay never fails halfway through on a malformed file.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such trace file")
    try:
        records = load_reasoning_records(path)
        if not is_int(record) or not 0 <= record < len(records):
            raise ValueError(f"record: expected an index in [0, {len(records)}) (complete records "
                             f"of {path.name}), got {record!r}")
        raw = records[record]["data"]
        if not isinstance(raw, dict) or not all(k.isdecimal() for k in raw):
            raise TypeError(f"record {record}'s data is not an object keyed by thought ids")
        data = {int(k): v for k, v in raw.items()}
    except (json.JSONDecodeError, KeyError, TypeError, AttributeError) as exc:
        raise ValueError(f"{path}: not a reasoning trace ({exc})") from exc
    try:
        _check_thoughts(data)
    except ValueError as exc:
        raise ValueError(f"{path}: record {record}: {exc}") from None
    return data


def _check_thoughts(data: dict[int, Any]) -> None:
    """The rules a replay relies on. Thought 0 is the prompt, of ``value >= 1`` tokens; every
    other thought has integer ``start`` >= 1 and ``end`` (``end = start - 1`` for one with no
    tokens), is the child of exactly one thought, and starts after its parent has started and
    ended (it forks the parent's last token)."""
    if 0 not in data:
        raise ValueError("no thought 0 (the prompt)")
    parent: dict[int, int] = {}
    for n, v in sorted(data.items()):
        if not isinstance(v, dict) or not {"value", "start", "end", "children"} <= v.keys():
            raise ValueError(f"thought {n}: expected an object with value, start, end and children")
        for key in ("value", "start", "end"):
            if not is_int(v[key]):
                raise ValueError(f"thought {n}: {key} is not an integer: {v[key]!r}")
        if n == 0 and v["value"] < 1:
            raise ValueError(f"thought 0: a prompt of {v['value']} tokens (expected at least 1)")
        if n != 0 and (v["start"] < 1 or v["end"] < v["start"] - 1):
            raise ValueError(f"thought {n}: start {v['start']}, end {v['end']} (expected "
                             f"1 <= start <= end + 1)")
        kids = v["children"]
        if not isinstance(kids, list) or not all(is_int(c) for c in kids):
            raise ValueError(f"thought {n}: children is not a list of thought ids: {kids!r}")
        for c in kids:
            if c == 0 or c not in data:
                raise ValueError(f"thought {n}: child {c} is not a thought of the record other "
                                 f"than 0")
            if c in parent:
                raise ValueError(f"thought {c} is a child of both {parent[c]} and {n}")
            parent[c] = n
    for n, v in data.items():
        if n == 0:
            continue
        if n not in parent:
            raise ValueError(f"thought {n}: no thought lists it as a child")
        p = data[parent[n]]
        if parent[n] != 0 and v["start"] <= max(p["start"], p["end"]):
            raise ValueError(f"thought {n} starts at {v['start']}, before its parent "
                             f"{parent[n]} has ended (start {p['start']}, end {p['end']})")


def replay_trace(
    engine: TreeEngine,
    path: str | os.PathLike[str],
    record: int = 0,
    max_iterations: int | None = None,
    tokens: str = "random",
    seed: int = 0,
    progress: Callable[[int], None] | None = None,
    count_io: bool = True,
) -> ReplayReport:
    """Replay ``record`` of trace ``path`` for up to ``max_iterations`` decode iterations.

    ``tokens``: ``"random"`` (uniform token ids) or ``"greedy"`` (each child of a thought
    starts with the next most likely token after its parent, then decodes greedily).
    ``count_io``: turn on ``engine.count_io`` for the replay (restored after) to fill the
    report's K/V byte counts; ``False`` leaves the engine as it is (the counts are then 0
    unless it counts already): a timed replay without the per-step plan recount. The
    replayed tree is gone from the cache when this returns.
    """
    if tokens not in TOKEN_MODES:
        raise ValueError(f"tokens: expected one of {', '.join(TOKEN_MODES)}, got {tokens!r}")
    max_iterations = int_at_least(max_iterations, "max_iterations", 1, or_none=True)
    data = load_trace(path, record)
    if data[0]["value"] > engine.max_positions:
        raise ValueError(f"a prompt of {data[0]['value']} tokens, more than the model's context "
                         f"of {engine.max_positions}")
    last = max(v["end"] for v in data.values())
    if max_iterations is not None:
        last = min(last, max_iterations)
    was_counting = engine.count_io
    engine.count_io = was_counting or bool(count_io)
    try:
        with release_on_error(engine):
            return _replay(engine, data, last, tokens, np.random.default_rng(seed), progress,
                           trace=Path(path).stem, record=record)
    finally:
        engine.count_io = was_counting


def _replay(engine: TreeEngine, data: dict[int, dict[str, Any]], last: int, tokens: str,
            rng: np.random.Generator, progress: Callable[[int], None] | None,
            **names: Any) -> ReplayReport:
    """Prefill node 0, then iterations ``1..last``: fork, decode one token each, prune."""
    starts: dict[int, list[int]] = defaultdict(list)
    for n, v in sorted(data.items()):
        if n != 0:
            starts[v["start"]].append(n)
    parent = {c: n for n, v in data.items() for c in v["children"]}
    vocab = engine.vocab_size
    t0 = time.perf_counter()
    prompt = rng.integers(0, vocab, data[0]["value"]).tolist()
    ((root, row),) = prefill(engine, [prompt])
    node, last_logits = {0: root}, {0: row}
    prefill_s = time.perf_counter() - t0
    io0, io_s0 = _io(engine), engine.stats["io_s"]
    next_tok: dict[int, int] = {}
    active: list[int] = []
    peak, max_active, decoded, thoughts = 0, 0, 0, 0
    t1 = time.perf_counter()
    for it in range(1, last + 1):
        born = starts.get(it, [])
        by_parent: dict[int, list[int]] = defaultdict(list)
        for n in born:
            by_parent[parent[n]].append(n)
        for p, kids in by_parent.items():
            firsts = _first_tokens(last_logits.pop(p, None), len(kids), tokens, rng, vocab)
            for kid, cache_node, t in zip(kids, engine.cache.fork(node[p], len(kids)), firsts):
                node[kid], next_tok[kid] = cache_node, t
        active += born
        thoughts += len(born)
        if not active:
            continue
        rows = engine.extend([(node[n], [next_tok[n]]) for n in active], logits="last")
        decoded += len(active)
        max_active = max(max_active, len(active))
        peak = max(peak, engine.cache.num_pages - engine.cache.num_free_pages)
        still = []
        for n, row in zip(active, rows):
            if data[n]["end"] > it:
                still.append(n)
                next_tok[n] = int(row.argmax()) if tokens == "greedy" else int(rng.integers(vocab))
            elif data[n]["children"]:
                last_logits[n] = row
            else:
                engine.cache.prune(node[n], release_unused_ancestors=True)
        active = still
        if progress is not None:
            progress(1)
    decode_s = time.perf_counter() - t1 - (engine.stats["io_s"] - io_s0)
    io1 = _io(engine)
    if engine.cache.is_live(root):  # stopped early: drop what is left of the tree
        engine.cache.prune(root)
    return ReplayReport(
        **names, iterations=last, prompt_tokens=len(prompt), thoughts=thoughts,
        max_active=max_active, decode_tokens=decoded, prefill_s=prefill_s, decode_s=decode_s,
        kv_bytes_deft=io1[0] - io0[0], kv_bytes_per_branch=io1[1] - io0[1], peak_pages=peak,
    )


def _io(engine: TreeEngine) -> tuple[int, int]:
    return engine.stats["kv_bytes_deft"], engine.stats["kv_bytes_per_branch"]


def _first_tokens(logits: torch.Tensor | None, n: int, mode: str, rng: np.random.Generator,
                  vocab: int) -> list[int]:
    """First tokens of ``n`` children: the parent's ``n`` most likely (greedy) or random."""
    if mode == "greedy" and logits is not None:
        return torch.topk(logits, n).indices.tolist()
    return rng.integers(0, vocab, n).tolist()
