"""``speculative_generate``: a :class:`~deft.engine.decoding.Batch` of speculative requests,
one per prompt, each a :class:`~deft.engine.speculation.SpecSearch` (draft trees verified
in one tree-attention forward per step, see :mod:`deft.engine.speculation`)."""

from __future__ import annotations

import dataclasses
import os
import time
from typing import Sequence

import torch

from ..core import TreeEngine
from ..decoding import Request, decode
from ..prompts import Prompt, as_prompts
from ..draft_trees import Shape
from ..drafters import Drafter, NgramDrafter
from ..params import GenerationResult, SamplingParams
from ..speculation import SpecParams, accept_greedy, accept_sampled

__all__ = ["speculative_generate", "accept_greedy", "accept_sampled"]


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
        tree every step, all verified in one forward; the drafter drafts for all at once).
    params:
        :class:`SamplingParams`; greedy by default. Greedy output equals plain greedy
        decoding's; sampled output follows the same distribution as plain sampling (each
        prompt with a generator of its own, seeded from ``params.seed`` and its index).
    drafter:
        A :class:`~deft.engine.drafters.Drafter`; prompt lookup (:class:`NgramDrafter`) by default.
    tree:
        The draft-tree shape: a :class:`TreeShape`/:class:`TopKShape`, Medusa choice paths
        or a choices JSON file; the drafter's ``default_shape`` when ``None``.
    max_new_tokens:
        Overrides ``params.max_new_tokens``.

    Returns one :class:`GenerationResult` per prompt, in order: the new token ids (a stop
    token included), their text, the sum of their log-probabilities under the target
    model, and ``stats``: ``finish_reason``, ``steps`` (forwards that gave tokens: the
    prompt's last, then one per draft tree), ``accepted`` (draft tokens accepted at each
    step), ``tokens_per_step`` (new tokens per step, the bonus token included),
    ``drafted`` (draft tokens verified), ``prompt_tokens``, and the call's ``seconds``,
    ``new_tokens_total``, ``tokens_per_s`` (prefill included), ``draft_s`` (drafting)
    and ``verify_s`` (the rest: forwards and acceptance).
    """
    if not isinstance(engine, TreeEngine):
        raise TypeError(f"engine: expected a deft TreeEngine, got {type(engine).__name__}")
    params = SamplingParams() if params is None else params
    if not isinstance(params, SamplingParams):
        raise TypeError(f"params: expected a SamplingParams, got {type(params).__name__}")
    if max_new_tokens is not None:
        params = dataclasses.replace(params, max_new_tokens=max_new_tokens)
    spec = SpecParams(NgramDrafter() if drafter is None else drafter, tree)
    spec.check(engine)
    ids = as_prompts(prompts, engine)
    seeds = [None] * len(ids) if params.seed is None else torch.randint(
        1 << 62, (len(ids),), generator=torch.Generator().manual_seed(params.seed)).tolist()
    requests = [Request(p, 1, dataclasses.replace(params, seed=s), strategy=spec)
                for p, s in zip(ids, seeds)]
    start, io0 = time.perf_counter(), engine.stats["io_s"]
    decode(engine, requests=requests)
    seconds = time.perf_counter() - start - (engine.stats["io_s"] - io0)
    new = sum(len(r.search.tokens) for r in requests)
    draft_s = sum(r.search.draft_s for r in requests)
    call = {"seconds": seconds, "new_tokens_total": new,
            "tokens_per_s": new / seconds if seconds > 0 else float("nan"),
            "draft_s": draft_s, "verify_s": seconds - draft_s}
    return [r.search.result(engine.tokenizer, call) for r in requests]
