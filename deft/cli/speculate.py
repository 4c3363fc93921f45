"""``deft speculate PROMPT...``: speculative decoding with draft token trees from the command line."""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

from . import common, parallel
from .common import CliError

__all__ = ["add_parser", "run"]

DRAFTERS = ("ngram", "model")


def add_parser(subparsers: Any) -> None:
    """Add the ``speculate`` command to ``deft``'s subcommands."""
    p = subparsers.add_parser(
        "speculate", parents=[common.model_flags(), common.prompt_flags(),
                              common.sampling_flags(0.0, "0 = greedy (default)")],
        help="generate with speculative decoding (draft token trees)",
        description="Generate from each PROMPT with speculative decoding: a drafter proposes a "
        "tree of draft tokens, the model verifies the whole tree in one forward with tree "
        "attention, and the accepted path is kept. Greedy output equals plain greedy decoding.")
    p.add_argument("--drafter", choices=DRAFTERS, default="ngram",
                   help="ngram: prompt lookup, no extra model (default); model: --draft-model")
    p.add_argument("--draft-model", metavar="PATH",
                   help="draft model (same vocabulary as --model) for --drafter model")
    p.add_argument("--tree", metavar="PATH",
                   help="Medusa choices JSON (Tree_Structure or paths) as the draft-tree shape")
    p.add_argument("--json", action="store_true",
                   help="print one JSON list: text, token_ids (generated only) and stats per prompt")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> None:
    """Run ``deft speculate``; user errors raise :class:`~deft.cli.CliError`."""
    try:
        results = _generate(args)
    except CliError:
        raise
    except (ValueError, TypeError, FileNotFoundError, RuntimeError) as exc:
        raise CliError(str(exc).splitlines()[0] if str(exc) else type(exc).__name__) from exc
    if args.json:
        print(json.dumps([{"text": r.text, "token_ids": r.token_ids, "stats": r.stats}
                          for r in results]))
        return
    for r in results:
        print(r.text)
    st = results[0].stats
    steps = sum(r.stats["steps"] for r in results)
    print(f"[speculate] {st['new_tokens_total']} tokens in {steps} verification steps "
          f"({st['new_tokens_total'] / max(steps, 1):.2f} per step), {st['tokens_per_s']:.1f} tokens/s",
          file=sys.stderr)


def _generate(args: argparse.Namespace) -> list:
    from ..cache import CacheFullError
    from ..engine import (ModelDrafter, NgramDrafter, SamplingParams, TreeEngine, TreeShape, as_shape,
                          speculative_generate)

    common.require_device(args.device)
    if (args.drafter == "model") != (args.draft_model is not None):
        raise CliError("--draft-model: expected a path with --drafter model, and only then")
    if args.tree is not None and not os.path.isfile(args.tree):
        raise CliError(f"--tree: no such file: {args.tree}")
    try:
        params = SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                                seed=args.seed, max_new_tokens=args.max_new_tokens)
    except ValueError as exc:
        raise common.flag_error(exc) from exc
    kind = ModelDrafter if args.drafter == "model" else NgramDrafter
    try:
        shape = as_shape(args.tree and TreeShape.from_file(args.tree), kind.default_shape)
    except ValueError as exc:
        raise CliError(f"--tree: {exc}") from exc
    model, tok = parallel.load(args)
    prompts = [tok.apply_chat_template(p) if args.chat else tok.encode(p) for p in args.prompt]
    # The engine checks free pages per append, rounded up: a page per draft node covers the
    # draft model's level-by-level appends, a page per PAGE_SIZE drafts one verified tree.
    needs = [(model, _pages(prompts, params, common.pages_for(shape.num_drafts + 1)))]
    drafts = args.drafter == "model" and parallel.leads(args)  # rank 0 alone drafts
    if drafts:
        draft_model, draft_tok = common.load_from(args.draft_model, args.device, "--draft-model", args.dtype)
        needs.append((draft_model, _pages(prompts, params, shape.num_drafts)))
    budget = common.KVBudget.of(args)
    pages = budget.pages(needs)
    drafter = (ModelDrafter(TreeEngine(draft_model, draft_tok,
                                       common.engine_config(pages[1], kv_dtype=args.kv_dtype)))
               if drafts else NgramDrafter())
    engine = parallel.engine(args, model, tok,
                             common.engine_config(pages[0], kv_dtype=args.kv_dtype))
    try:
        return speculative_generate(engine, prompts, params, drafter, shape)
    except CacheFullError as exc:
        raise budget.error(exc) from exc


def _pages(prompts: list[list[int]], params: Any, per_step: int) -> int:
    """Pages for every prompt and its output, plus ``per_step`` per prompt."""
    return sum(common.pages_for(len(p) + params.max_new_tokens) + per_step + 2 for p in prompts)
