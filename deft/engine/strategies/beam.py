"""``beam_search``: a :class:`~deft.engine.decoding.Batch` of beam-search requests, one per
prompt, each a :class:`~deft.engine.beams.BeamSearch` (``transformers``' semantics, see
:mod:`deft.engine.beams`)."""

from __future__ import annotations

import time
from typing import Callable, Sequence

from ..beams import BeamParams
from ..core import TreeEngine
from ..decoding import Request, decode, release_on_error
from ..prompts import Prompt, as_prompts
from ..params import GenerationResult, SamplingParams

__all__ = ["beam_search"]


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
    ``sequences_scores``); ``stats`` has ``sum_logprob`` and ``finish_reason``. All
    prompts' beams advance in one forward per step (a :class:`~deft.engine.decoding.Batch`);
    ``progress(n)`` is called with the beam tokens computed each step.
    """
    params = BeamParams(num_beams, max_new_tokens, length_penalty, early_stopping,
                        num_return_sequences, stop_token_ids)
    params.check(engine)
    requests = [Request(p, params.num_beams, SamplingParams(max_new_tokens=params.max_new_tokens),
                        strategy=params) for p in as_prompts(prompts, engine)]
    t0, steps0, io0 = time.perf_counter(), engine.stats["steps"], engine.stats["io_s"]
    with release_on_error(engine):
        decode(engine, requests=requests, progress=progress)
    seconds = time.perf_counter() - t0 - (engine.stats["io_s"] - io0)
    call = {"seconds": seconds, "steps": engine.stats["steps"] - steps0}
    return [r.search.results(engine.tokenizer, call) for r in requests]
