"""Speculative decoding with token trees, verified in one tree-attention forward per step.

Each step, for every active sequence: the drafter grows a draft tree whose root is the
sequence's newest token (its K/V not yet cached); all trees of the batch are added under
their sequences' leaves (each draft token a 1-token node) and run through the target
model in ONE forward, every query seeing exactly its own path. Acceptance walks each tree
from the root (greedy: follow the child equal to the target's argmax; sampling: tree
rejection sampling, see :func:`accept_sampled`), the accepted path is committed to the
leaf (:meth:`TreeKVCache.commit_path`) and every other draft is pruned at once. The step
yields the accepted drafts plus one token chosen from the target's distribution at the
last accepted node.
"""

from __future__ import annotations

import dataclasses
import os
import time
from dataclasses import dataclass, field
from typing import Sequence

import torch

from ...model.tokenizer import Tokenizer
from ..core import TreeEngine
from ..decoding import Prompt, as_prompts
from ..draft_trees import DraftTree, Shape, TreeGrower, as_shape
from ..drafters import DraftJob, Drafter, NgramDrafter
from ..params import GenerationResult, SamplingParams
from ..sampling import probabilities

__all__ = ["speculative_generate", "accept_greedy", "accept_sampled"]


def accept_greedy(tree: DraftTree, logits: torch.Tensor) -> tuple[list[int], int]:
    """Greedy acceptance of ``tree`` under target ``logits [len(tree), vocab]``.

    Returns the accepted draft nodes (a path from the root, root excluded) and the next
    token: the argmax at the last accepted node. The tokens are exactly those greedy
    decoding would produce from the same logits.
    """
    target = logits.argmax(-1).tolist()
    path, node = [], 0
    while True:
        token = target[node]
        nxt = next((c for c in tree.children[node] if tree.tokens[c] == token), None)
        if nxt is None:
            return path, token
        path.append(nxt)
        node = nxt


def accept_sampled(tree: DraftTree, probs: torch.Tensor,
                   generator: torch.Generator) -> tuple[list[int], int]:
    """Tree rejection sampling of ``tree`` under target probabilities ``probs [len(tree), vocab]``.

    At each node, starting at the root, the children are tried in order. Child ``x`` drawn
    from the draft distribution ``q`` is accepted with probability ``min(1, p(x) / q(x))``;
    on rejection ``p <- norm(max(p - q, 0))`` and ``q <- norm(q`` without ``x)`` (the next
    sibling was drawn without replacement). A deterministic child (``q`` a point mass on
    ``x``) is accepted with probability ``p(x)``, and on rejection ``x`` is removed from
    ``p``. After an acceptance the walk continues at the child; when every child is
    rejected (or at a leaf) the next token is drawn from the current ``p``. Each emitted
    token is thus distributed exactly as ``p`` given the tokens before it.

    Returns the accepted draft nodes and the next token.
    """
    path, node = [], 0
    while True:
        p = probs[node].double()
        q = tree.draft_probs.get(node)
        q = None if q is None else q.double()
        accepted = None
        for child in tree.children[node]:
            x = tree.tokens[child]
            qx = 1.0 if q is None else float(q[x])
            u = float(torch.rand((), generator=generator, dtype=torch.float64))
            if qx > 0 and u * qx < float(p[x]):  # probability min(1, p(x) / q(x))
                accepted = child
                break
            if q is None:
                residual = p.clone()
                residual[x] = 0.0
            else:
                residual = (p - q).clamp_min(0.0)
                q = q.clone()
                q[x] = 0.0
                q = q / q.sum() if q.sum() > 0 else q
            total = residual.sum()
            if total > 0:  # else p == q up to rounding, and x was accepted almost surely
                p = residual / total
        if accepted is None:
            return path, int(torch.multinomial(p, 1, generator=generator))
        path.append(accepted)
        node = accepted


@dataclass
class _Sequence:
    """One prompt's progress: ``tokens`` = prompt + output; ``node`` holds the K/V of all
    but the last token."""

    key: int
    tokens: list[int]
    prompt_len: int
    node: int = -1
    logprob: float = 0.0
    accepted: list[int] = field(default_factory=list)
    drafted: int = 0
    finish_reason: str | None = None

    @property
    def output(self) -> list[int]:
        return self.tokens[self.prompt_len :]

    def emit(self, tokens: list[int], logprobs: list[float], stop: frozenset[int], limit: int) -> None:
        """Append accepted ``tokens`` up to a stop token or ``limit`` new tokens."""
        for tok, lp in zip(tokens, logprobs):
            self.tokens.append(tok)
            self.logprob += lp
            if tok in stop:
                self.finish_reason = "stop"
            elif len(self.tokens) - self.prompt_len >= limit:
                self.finish_reason = "length"
            if self.finish_reason:
                return


def speculative_generate(
    engine: TreeEngine,
    prompts: Prompt | Sequence[Prompt],
    params: SamplingParams | None = None,
    drafter: Drafter | None = None,
    tree: Shape | Sequence[Sequence[int]] | str | os.PathLike[str] | None = None,
    max_new_tokens: int | None = None,
) -> list[GenerationResult]:
    """Generate from each prompt with speculative decoding over draft token trees.

    Parameters
    ----------
    engine:
        The target model's :class:`~deft.engine.TreeEngine`.
    prompts:
        A str or token-id list, or a list of them (a batch: each prompt has its own draft
        tree every step, all verified in one forward).
    params:
        :class:`SamplingParams`; greedy by default. Greedy output equals plain greedy
        decoding's; sampled output follows the same distribution as plain sampling.
    drafter:
        A :class:`~deft.engine.drafters.Drafter`; prompt lookup (:class:`NgramDrafter`) by default.
    tree:
        The draft-tree shape: a :class:`TreeShape`/:class:`TopKShape`, Medusa choice paths
        or a choices JSON file; the drafter's ``default_shape`` when ``None``.
    max_new_tokens:
        Overrides ``params.max_new_tokens``.

    Returns one :class:`GenerationResult` per prompt, in order: the new token ids (a stop
    token included), their text, the sum of their log-probabilities under the target
    model, and ``stats``: ``finish_reason``, ``steps`` (verification forwards),
    ``accepted`` (draft tokens accepted at each step), ``tokens_per_step`` (new tokens per
    step, the bonus token included), ``drafted`` (draft tokens verified), ``prompt_tokens``,
    and the call's ``seconds``, ``new_tokens_total``, ``tokens_per_s`` (prefill included),
    ``draft_s`` and ``verify_s``.
    """
    if not isinstance(engine, TreeEngine):
        raise TypeError(f"engine: expected a deft TreeEngine, got {type(engine).__name__}")
    params = SamplingParams() if params is None else params
    if not isinstance(params, SamplingParams):
        raise TypeError(f"params: expected a SamplingParams, got {type(params).__name__}")
    if max_new_tokens is not None:
        params = dataclasses.replace(params, max_new_tokens=max_new_tokens)
    drafter = NgramDrafter() if drafter is None else drafter
    if not isinstance(drafter, Drafter):
        raise TypeError(f"drafter: expected a deft Drafter, got {type(drafter).__name__}")
    vocab = getattr(drafter, "vocab_size", engine.vocab_size)
    if vocab != engine.vocab_size:
        raise ValueError(f"drafter: expected the target's vocabulary of {engine.vocab_size} tokens, "
                         f"got a draft model with {vocab}")
    shape = as_shape(tree, drafter.default_shape)
    seqs = [_Sequence(i, ids, len(ids)) for i, ids in enumerate(as_prompts(prompts, engine))]
    generator = torch.Generator()
    if params.seed is None:
        generator.seed()
    else:
        generator.manual_seed(params.seed)
    stop = params.stop_ids(engine.tokenizer)
    timing = {"draft_s": 0.0, "verify_s": 0.0}
    start = time.perf_counter()
    try:
        for s in seqs:
            s.node = engine.add_prompt(s.tokens[:-1])  # computed with the first draft tree
        active = seqs
        while active:
            _step(engine, active, params, drafter, shape, generator, stop, timing)
            for s in active:
                if s.finish_reason is None and len(s.tokens) > engine.max_positions:
                    s.finish_reason = "length"  # the newest token has no position left
                if s.finish_reason is not None:
                    _release(engine, drafter, s)
            active = [s for s in active if s.finish_reason is None]
    finally:
        for s in seqs:
            if s.finish_reason is None and s.node >= 0:  # stopped by an error
                _release(engine, drafter, s)
    seconds = time.perf_counter() - start
    new = sum(len(s.output) for s in seqs)
    call = {"seconds": seconds, "new_tokens_total": new,
            "tokens_per_s": new / seconds if seconds > 0 else float("nan"), **timing}
    return [_result(engine.tokenizer, s, call) for s in seqs]


def _step(engine: TreeEngine, seqs: list[_Sequence], params: SamplingParams, drafter: Drafter,
          shape: Shape, generator: torch.Generator, stop: frozenset[int], timing: dict) -> None:
    """One draft + verify + accept round for every sequence in ``seqs``."""
    limit = params.max_new_tokens
    jobs = []
    for s in seqs:
        room = min(limit - len(s.output), engine.max_positions - len(s.tokens) + 1)
        jobs.append(DraftJob(s.key, s.tokens, TreeGrower(shape, s.tokens[-1], room - 1)))
    t0 = time.perf_counter()
    drafter.draft(jobs, params, generator)
    t1 = time.perf_counter()
    trees = [job.grower.tree for job in jobs]
    verified = engine.extend_trees([(s.node, t.parents, t.tokens) for s, t in zip(seqs, trees)])
    logits = torch.cat([lg for _, lg in verified])  # [sum of tree sizes, vocab]
    if params.greedy:
        per_tree = torch.split(logits, [len(t) for t in trees])
        accepted = [accept_greedy(t, lg) for t, lg in zip(trees, per_tree)]
    else:
        probs = torch.split(probabilities(logits, params).cpu(), [len(t) for t in trees])
        accepted = [accept_sampled(t, p, generator) for t, p in zip(trees, probs)]
    new, rows, base = [], [], 0
    for s, tree, (ids, _), (path, bonus) in zip(seqs, trees, verified, accepted):
        engine.cache.commit_path(s.node, [ids[0]] + [ids[c] for c in path])
        new.append([tree.tokens[c] for c in path] + [bonus])
        rows += [base + c for c in (0, *path)]
        base += len(tree)
    flat = torch.tensor([t for toks in new for t in toks], device=logits.device)
    logp = torch.log_softmax(logits[rows], -1).gather(-1, flat[:, None]).squeeze(-1).tolist()
    for s, tree, toks, (path, _) in zip(seqs, trees, new, accepted):
        s.accepted.append(len(path))
        s.drafted += len(tree) - 1
        s.emit(toks, logp[: len(toks)], stop, limit)
        logp = logp[len(toks) :]
    timing["draft_s"] += t1 - t0
    timing["verify_s"] += time.perf_counter() - t1


def _release(engine: TreeEngine, drafter: Drafter, s: _Sequence) -> None:
    drafter.release(s.key)
    engine.cache.prune(s.node)


def _result(tokenizer: Tokenizer, s: _Sequence, call: dict) -> GenerationResult:
    out, steps = s.output, len(s.accepted)
    stats = {
        "finish_reason": s.finish_reason,
        "prompt_tokens": s.prompt_len,
        "steps": steps,
        "accepted": s.accepted,
        "tokens_per_step": len(out) / steps if steps else float("nan"),
        "drafted": s.drafted,
        **call,
    }
    return GenerationResult(out, tokenizer.decode(out, skip_special_tokens=True), s.logprob, stats)
