"""Beam search over the tree cache, with ``transformers``' semantics.

The beams of a prompt are leaves of one tree: a beam continued by one candidate grows
in place, a beam continued by several is forked (its K/V shared, not copied), a beam
not continued is pruned at once with every ancestor no other beam uses. All prompts'
beams advance in one forward per step.

Scores follow ``transformers``' ``_beam_search`` (v5): each step the top ``max(2, 1 +
#stop ids) * k`` continuations of all beams by summed log-probability (float32); the
best ``k`` that do not stop continue; a candidate among the top ``k`` that ends with a
stop token (or reaches ``max_new_tokens``) becomes a finished hypothesis scored
``sum_logprobs / generated_len ** length_penalty``, the best ``k`` of which are kept.
The search ends at ``max_new_tokens``, when ``early_stopping=True`` and ``k``
hypotheses are finished, or when no running beam can beat the worst kept hypothesis
(``early_stopping=False``: judged at the current length; ``"never"``: at
``max_new_tokens`` if ``length_penalty > 0``).
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Callable, Sequence

import numpy as np
import torch

from ...checks import int_at_least, real_number
from ..core import TreeEngine
from ..decoding import Prompt, as_prompts, prefill, release_on_error
from ..params import GenerationResult, SamplingParams

__all__ = ["beam_search"]

_F = np.float32


@dataclass
class _Beam:
    node: int
    tokens: list[int]
    score: np.float32  # sum of log-probabilities, float32 as in transformers


@dataclass
class _Search:
    """One prompt's beam search."""

    prompt_len: int
    max_new: int  # max_new_tokens, capped by the context
    running: list[_Beam]
    logits: torch.Tensor | None = None  # [len(running), vocab] of the running beams
    finished: list[tuple[np.float32, list[int], np.float32]] = field(default_factory=list)
    improvable: bool = True
    done: bool = False


def beam_search(
    engine: TreeEngine,
    prompts: Prompt | Sequence[Prompt],
    num_beams: int,
    max_new_tokens: int = 64,
    length_penalty: float = 1.0,
    early_stopping: bool | str = False,
    num_return_sequences: int = 1,
    stop_token_ids: frozenset[int] | None = None,
    progress: Callable[[int], None] | None = None,
) -> list[list[GenerationResult]]:
    """Beam search for each prompt; per prompt the ``num_return_sequences`` best hypotheses.

    Returns the same sequences as ``transformers`` ``generate(num_beams=k,
    do_sample=False, length_penalty=..., early_stopping=...)`` with the same stop ids.
    Each result's ``score`` is the hypothesis' length-penalised score (``transformers``'
    ``sequences_scores``); ``stats`` has ``sum_logprob`` and ``finish_reason``.
    """
    k = int_at_least(num_beams, "num_beams", 1)
    max_new = int_at_least(max_new_tokens, "max_new_tokens", 1)
    n_ret = int_at_least(num_return_sequences, "num_return_sequences", 1)
    if n_ret > k:
        raise ValueError(f"num_return_sequences: expected at most num_beams={k}, got {n_ret}")
    if early_stopping not in (True, False, "never"):
        raise ValueError(f"early_stopping: expected True, False or 'never', got {early_stopping!r}")
    length_penalty = real_number(length_penalty, "length_penalty")
    stop = SamplingParams(stop_token_ids=stop_token_ids).stop_ids(engine.tokenizer)  # validated
    width = max(2, 1 + len(stop)) * k
    if width > engine.vocab_size:
        raise ValueError(f"num_beams: {k} beams need {width} candidates per step, more than "
                         f"the vocabulary of {engine.vocab_size}")
    batch = as_prompts(prompts, engine)
    t0, steps0, io0 = time.perf_counter(), engine.stats["steps"], engine.stats["io_s"]

    with release_on_error(engine):
        searches = _run(engine, batch, max_new, (k, width, stop, length_penalty, early_stopping),
                        progress)
    seconds = time.perf_counter() - t0 - (engine.stats["io_s"] - io0)
    call = {"seconds": seconds, "steps": engine.stats["steps"] - steps0}
    tok = engine.tokenizer
    return [[GenerationResult(toks, tok.decode(toks, skip_special_tokens=True), float(score),
                              {"sum_logprob": float(logp),
                               "finish_reason": "stop" if toks and toks[-1] in stop else "length",
                               "prompt_tokens": s.prompt_len, **call})
             for score, toks, logp in s.finished[:n_ret]] for s in searches]


def _run(engine: TreeEngine, batch: list[list[int]], max_new: int, cfg: tuple,
         progress: Callable[[int], None] | None) -> list[_Search]:
    """Prefill ``batch`` and step every search until all are done; one forward per step."""
    searches = [
        _Search(len(p), min(max_new, engine.max_positions - len(p) + 1), [_Beam(node, [], _F(0))], row[None])
        for p, (node, row) in zip(batch, prefill(engine, batch))
    ]
    while True:
        items, owners = [], []
        for s in searches:
            if s.done:
                continue
            new_items = _grow(engine, s, _advance(s, *cfg))
            items += new_items
            owners += [s] * len(new_items)
        if not items:
            return searches
        rows = engine.extend(items, logits="last")
        for s in {id(s): s for s in owners}.values():
            s.logits = torch.stack([row for row, o in zip(rows, owners) if o is s])
        if progress is not None:
            progress(len(items))


def _advance(s: _Search, k: int, width: int, stop: frozenset[int], lp: float,
             early_stopping: bool | str) -> list[_Beam]:
    """One beam-search step of ``s`` from its logits: new running beams, finished hypotheses.

    Returns the previous running beams (their nodes are the new beams' parents).
    """
    logp = torch.log_softmax(s.logits.float(), dim=-1)  # [beams, vocab]
    scores = torch.tensor([b.score for b in s.running], dtype=torch.float32, device=logp.device)
    acc = (logp + scores[:, None]).reshape(-1)
    top = torch.topk(acc, min(width, acc.shape[0]))
    vocab = logp.shape[1]
    gen_len = len(s.running[0].tokens) + 1
    last = gen_len >= s.max_new
    cands = [(_F(v), i // vocab, i % vocab) for v, i in zip(top.values.tolist(), top.indices.tolist())]
    hits = [last or tok in stop for _, _, tok in cands]

    full = len(s.finished) == k
    if s.improvable and not (full and early_stopping is True):
        denom = _F(gen_len ** lp)
        for (v, beam, tok), hit in zip(cands[:k], hits[:k]):
            if hit:
                s.finished.append((_F(v / denom), s.running[beam].tokens + [tok], v))
        s.finished.sort(key=lambda h: -h[0])  # stable: earlier hypotheses win ties
        del s.finished[k:]

    parents = s.running
    s.running = [_Beam(parents[beam].node, parents[beam].tokens + [tok], v)
                 for (v, beam, tok), hit in zip(cands, hits) if not hit][:k]
    s.logits = None
    if s.running:
        best_len = s.max_new if early_stopping == "never" and lp > 0 else gen_len
        best = _F(s.running[0].score / _F(best_len ** lp))
        s.improvable = s.improvable and (len(s.finished) < k or best > min(h[0] for h in s.finished))
    full = len(s.finished) == k
    s.done = all(hits) or not s.improvable or (full and early_stopping is True)
    return parents


def _grow(engine: TreeEngine, s: _Search, parents: list[_Beam]) -> list[tuple[int, list[int]]]:
    """Move ``s``'s K/V from ``parents`` to its new beams; the (node, [token]) items to compute."""
    cache = engine.cache
    if s.done:
        for b in parents:
            cache.prune(b.node, release_unused_ancestors=True)
        s.running = []
        return []
    by_node = Counter(b.node for b in s.running)
    for b in parents:
        if b.node not in by_node:
            cache.prune(b.node, release_unused_ancestors=True)
    forks = {node: cache.fork(node, n) for node, n in by_node.items() if n > 1}
    items = []
    for b in s.running:
        if b.node in forks:
            b.node = forks[b.node].pop()
        items.append((b.node, b.tokens[-1:]))
    return items

