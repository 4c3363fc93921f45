"""``deft generate``, ``deft sample`` and ``deft beam``: the generation commands."""

from __future__ import annotations

import argparse
import json
import math
import sys
from typing import Any, Callable

from . import common, parallel
from .common import CliError, in_range

__all__ = ["MAX_BEAMS", "MAX_SAMPLES", "add_parsers"]

MAX_SAMPLES, MAX_BEAMS = 256, 64
# deft.engine.beams.MAX_LENGTH_PENALTY, kept here so that the CLI starts without the engine
MAX_LENGTH_PENALTY = 32
EARLY_STOPPING = {"false": False, "true": True, "never": "never"}


def add_parsers(subparsers: Any) -> None:
    """Add ``generate``, ``sample`` and ``beam`` to ``deft``'s subcommands."""
    gen = argparse.ArgumentParser(add_help=False, parents=[common.model_flags(), common.prompt_flags()])
    gen.add_argument("--json", action="store_true",
                     help="print one JSON list: per result prompt index, text, token_ids "
                     "(generated only, stop token included), score, finish_reason")
    sampling = common.sampling_flags(None, "0 = greedy (default: 0 for generate, 1 for sample)")

    g = subparsers.add_parser("generate", parents=[gen, sampling], help="generate a continuation per prompt",
                              description="Generate one continuation per PROMPT; all prompts advance in one "
                              "forward per step. Greedy unless --temperature > 0.")
    g.set_defaults(func=run_generate)
    s = subparsers.add_parser("sample", parents=[gen, sampling], help="N samples per prompt sharing its KV",
                              description="Draw N samples per PROMPT: the branches fork from the prompt "
                              "and share its KV cache; every branch of every prompt advances in one "
                              "forward per step.")
    s.add_argument("-n", type=int, required=True, help=f"samples per prompt (1..{MAX_SAMPLES})")
    s.set_defaults(func=run_sample)
    b = subparsers.add_parser("beam", parents=[gen], help="beam search (same results as transformers)",
                              description="Beam search with K beams per PROMPT, as transformers' "
                              "generate(num_beams=K): beams are leaves of one tree, pruned beams "
                              "release their KV at once.")
    b.add_argument("-k", type=int, required=True, help=f"beams per prompt (1..{MAX_BEAMS})")
    b.add_argument("--length-penalty", type=float, default=1.0,
                   help=f"score = sum logprob / length ** this (default 1.0, at most {MAX_LENGTH_PENALTY} "
                   "either way)")
    b.add_argument("--early-stopping", choices=list(EARLY_STOPPING), default="false",
                   help="transformers' early_stopping (default false)")
    b.add_argument("--num-return-sequences", type=int, default=1, metavar="R",
                   help="hypotheses to print per prompt (1..K, default 1)")
    b.set_defaults(func=run_beam)


def run_generate(args: argparse.Namespace) -> None:
    from ..engine import generate

    params = _params(args, 0.0)
    results = _run_engine(args, 1, lambda eng, prompts, bar: generate(eng, prompts, params, progress=bar))
    _report(args, [[r] for r in results], "sample")


def run_sample(args: argparse.Namespace) -> None:
    from ..engine import sample

    n = in_range(args.n, "-n", 1, MAX_SAMPLES)
    params = _params(args, 1.0)
    if params.greedy:
        raise CliError("--temperature 0: the samples would all be the greedy sequence; "
                       "use a temperature > 0, or deft generate")
    results = _run_engine(args, n, lambda eng, prompts, bar: sample(eng, prompts, n, params, progress=bar))
    _report(args, results, "sample")


def run_beam(args: argparse.Namespace) -> None:
    from ..engine import beam_search

    k = in_range(args.k, "-k", 1, MAX_BEAMS)
    if not (math.isfinite(args.length_penalty) and abs(args.length_penalty) <= MAX_LENGTH_PENALTY):
        raise CliError(f"--length-penalty: expected a number in [-{MAX_LENGTH_PENALTY}, "
                       f"{MAX_LENGTH_PENALTY}], got {args.length_penalty}")
    ret = in_range(args.num_return_sequences, "--num-return-sequences", 1, k)
    stop = EARLY_STOPPING[args.early_stopping]
    results = _run_engine(args, k, lambda eng, prompts, bar: beam_search(
        eng, prompts, k, args.max_new_tokens, args.length_penalty, stop, ret, progress=bar))
    _report(args, results, "beam")


def _params(args: argparse.Namespace, default_temperature: float) -> Any:
    """``SamplingParams`` from the flags; a bad value names its flag."""
    from ..engine import SamplingParams

    temperature = default_temperature if args.temperature is None else args.temperature
    if temperature == 0:
        for flag, value, off in (("--top-k", args.top_k, 0), ("--top-p", args.top_p, 1.0),
                                 ("--seed", args.seed, None)):
            if value != off:
                raise CliError(f"{flag}: has no effect with --temperature 0 (greedy); "
                               "set --temperature > 0 to sample")
    try:
        return SamplingParams(temperature=temperature, top_k=args.top_k, top_p=args.top_p,
                              seed=args.seed, max_new_tokens=args.max_new_tokens)
    except ValueError as exc:
        raise common.flag_error(exc) from exc


def _run_engine(args: argparse.Namespace, branches: int,
                run: Callable[[Any, list[list[int]], Callable[[int], None]], list]) -> list:
    """Load the model, encode the prompts, size the cache and call ``run(engine, prompts, progress)``.

    The pool holds what every request could need at once, or what the K/V budget allows if
    that is less: then generate and sample run the requests that fit and the others wait
    (beam search stops with the one-line error).
    """
    from tqdm import tqdm

    from ..cache import CacheFullError

    in_range(args.max_new_tokens, "--max-new-tokens", 1, 1 << 20)
    model, tok = parallel.load(args)
    try:
        prompts = [tok.apply_chat_template(p) if args.chat else tok.encode(p) for p in args.prompt]
    except ValueError as exc:
        raise CliError(f"--chat: {exc}") from exc
    for i, p in enumerate(prompts):
        if not p:
            raise CliError(f"PROMPT {i + 1}: encodes to no tokens")
        if len(p) > model.config.max_position_embeddings:
            raise CliError(f"PROMPT {i + 1}: {len(p)} tokens, longer than {model.config.context_text}")
    # What the requests could need at most: each prompt, each branch's tokens up to the model's
    # context, a page per branch for copying a partly filled page, doubled as headroom.
    context = model.config.max_position_embeddings
    tokens = sum(len(p) + branches * (min(args.max_new_tokens, context - len(p)) + 16) for p in prompts)
    budget = common.KVBudget.of(args)
    (num_pages,) = budget.pages([(model, 2 * common.pages_for(tokens) + 8)])
    engine = parallel.engine(args, model, tok,
                             common.engine_config(num_pages, args.device, args.kv_dtype))
    total = len(prompts) * branches * args.max_new_tokens
    with tqdm(total=total, unit="tok", desc=args.command, leave=False, disable=None) as bar:
        try:
            return run(engine, prompts, bar.update)
        except CacheFullError as exc:
            raise budget.error(exc) from exc
        except ValueError as exc:
            raise CliError(str(exc)) from exc


def _report(args: argparse.Namespace, groups: list[list[Any]], label: str) -> None:
    """Results as JSON (one list) or as text, and a speed line on stderr."""
    flat = [(i, j, r) for i, group in enumerate(groups) for j, r in enumerate(group)]
    if args.json:
        print(json.dumps([{"prompt": i, label: j, "text": r.text, "token_ids": r.token_ids,
                           "score": r.score, "finish_reason": r.stats["finish_reason"]}
                          for i, j, r in flat]))
    else:
        for i, j, r in flat:
            head = f"[prompt {i + 1}" + (f", {label} {j + 1}" if len(groups[i]) > 1 else "")
            print(f"{head}, score {r.score:.3f}]\n{r.text}\n")
    st = flat[0][2].stats
    new = sum(len(r.token_ids) for _, _, r in flat)
    print(f"[{args.command}] {new} new tokens in {st['seconds']:.2f} s "
          f"({new / st['seconds']:.1f} tokens/s, {st['steps']} forwards)", file=sys.stderr)
