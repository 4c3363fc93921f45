"""``deft speculate PROMPT...``: speculative decoding with draft token trees from the command line."""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

__all__ = ["add_parser"]


def add_parser(subparsers: Any) -> None:
    """Add the ``speculate`` command to ``deft``'s subcommands."""
    p = subparsers.add_parser(
        "speculate", help="generate with speculative decoding (draft token trees)",
        description="Generate from each PROMPT with speculative decoding: a drafter proposes a "
        "tree of draft tokens, the model verifies the whole tree in one forward with tree "
        "attention, and the accepted path is kept. Greedy output equals plain greedy decoding.")
    p.add_argument("prompt", nargs="+", help="prompt text (several: one batch)")
    p.add_argument("--max-new-tokens", type=int, default=64, help="tokens to generate (default 64)")
    p.add_argument("--model", metavar="PATH",
                   help="GGUF file or HF directory (default: SmolLM2-135M-Instruct)")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--chat", action="store_true", help="wrap each prompt in the model's chat template")
    p.add_argument("--drafter", choices=["ngram", "model"], default="ngram",
                   help="ngram: prompt lookup, no extra model (default); model: --draft-model")
    p.add_argument("--draft-model", metavar="PATH",
                   help="draft model (same vocabulary as --model) for --drafter model")
    p.add_argument("--tree", metavar="PATH",
                   help="Medusa choices JSON (Tree_Structure or paths) as the draft-tree shape")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int)
    p.add_argument("--json", action="store_true",
                   help="print one JSON list: text, token_ids (generated only) and stats per prompt")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> None:
    """Run ``deft speculate``; user errors raise :class:`deft.cli.CliError`."""
    from .cli import CliError

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
    import torch

    from .cli import CliError
    from .engine.core import SamplingParams, TreeEngine
    from .engine.drafters import ModelDrafter, NgramDrafter
    from .engine.speculative import speculative_generate
    from .engine.trees import TreeShape, as_shape
    from .model import load_model

    if args.device == "cuda" and not torch.cuda.is_available():
        raise CliError("--device cuda: no CUDA device is available")
    if (args.drafter == "model") != (args.draft_model is not None):
        raise CliError("--draft-model: expected a path with --drafter model, and only then")
    if args.tree is not None and not os.path.isfile(args.tree):
        raise CliError(f"--tree: no such file: {args.tree}")
    params = SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                            seed=args.seed, max_new_tokens=args.max_new_tokens)
    kind = ModelDrafter if args.drafter == "model" else NgramDrafter
    shape = as_shape(args.tree and TreeShape.from_file(args.tree), kind.default_shape)
    model, tok = load_model(args.model, device=args.device)
    prompts = [tok.apply_chat_template(p) if args.chat else tok.encode(p) for p in args.prompt]
    # The engine checks free pages per append, rounded up: a page per draft node covers the
    # draft model's level-by-level appends, a page per 16 drafts one verified tree.
    if args.drafter == "model":
        draft_model, draft_tok = load_model(args.draft_model, device=args.device)
        pages = _pages(prompts, params, shape.num_drafts)
        drafter = ModelDrafter(TreeEngine(draft_model, draft_tok, pages))
    else:
        drafter = NgramDrafter()
    engine = TreeEngine(model, tok, _pages(prompts, params, -(-(shape.num_drafts + 1) // 16)))
    return speculative_generate(engine, prompts, params, drafter, shape)


def _pages(prompts: list[list[int]], params: Any, per_step: int) -> int:
    """Pages (of 16 slots) for every prompt and its output, plus ``per_step`` per prompt."""
    return sum(-(-(len(p) + params.max_new_tokens) // 16) + per_step + 2 for p in prompts)
