"""``deft replay [TRACE]``: drive the engine through a recorded reasoning tree."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from . import common, parallel
from .common import CliError, in_range

__all__ = ["add_parser", "run"]


def add_parser(subparsers: Any) -> None:
    """Add the ``replay`` command to ``deft``'s subcommands."""
    from ..engine.strategies.replay import TOKEN_MODES

    rp = subparsers.add_parser("replay", parents=[common.model_flags()], help="replay a recorded reasoning tree",
                               description="Drive the engine through a recorded Graph-of-Thoughts tree: "
                               "each iteration every active thought decodes one token in one forward, "
                               "thoughts branch and end as recorded. Reports tokens/s and the K/V bytes "
                               "DeFT reads against per-branch decoding.")
    rp.add_argument("trace", nargs="?", default="keywordToT", metavar="TRACE",
                    help="a reasoning JSON file, or a task name under the recorded workloads: "
                    "keywordToT (default), docmergeToT, sorting128ToT")
    common.add_workloads_flag(rp)
    rp.add_argument("--record", type=int, default=0, help="index among the complete records (default 0)")
    rp.add_argument("--iterations", type=int, metavar="N", help="stop after N iterations (default: all)")
    rp.add_argument("--tokens", choices=TOKEN_MODES, default="random",
                    help="decoded token ids: random (default) or greedy")
    rp.add_argument("--json", action="store_true", help="print the report as one JSON object")
    rp.set_defaults(func=run)


def run(args: argparse.Namespace) -> None:
    from dataclasses import asdict

    from tqdm import tqdm

    from ..cache import CacheFullError
    from ..engine import load_trace, replay_trace

    path = Path(args.trace)
    if not path.suffix:  # a task name
        path = _task_trace(args.trace, args.workloads)
    if args.iterations is not None:
        in_range(args.iterations, "--iterations", 1, 1 << 30)
    try:
        data = load_trace(path, args.record)
    except (FileNotFoundError, ValueError) as exc:
        raise CliError(f"TRACE: {exc}") from exc
    model, tok = parallel.load(args)
    tokens = sum(v["value"] for v in data.values())
    budget = common.KVBudget.of(args)
    (num_pages,) = budget.pages([(model, common.pages_for(tokens) + 2 * len(data) + 8)])
    engine = parallel.engine(args, model, tok,
                             common.engine_config(num_pages, args.device, args.kv_dtype))
    last = max(v["end"] for v in data.values())
    total = min(last, args.iterations or last)
    with tqdm(total=total, unit="it", desc="replay", leave=False, disable=None) as bar:
        try:
            r = replay_trace(engine, path, args.record, args.iterations, args.tokens, progress=bar.update)
        except CacheFullError as exc:
            raise budget.error(exc) from exc
        except ValueError as exc:  # e.g. a trace deeper than the model's context
            raise CliError(f"TRACE {path.name}: {exc}") from exc
    if args.json:
        print(json.dumps({**asdict(r), "tokens_per_s": r.tokens_per_s, "kv_ratio": r.kv_ratio}))
        return
    print(f"{r.trace} record {r.record}: {r.iterations} iterations, {r.prompt_tokens}-token prompt, "
          f"{r.thoughts} thoughts (up to {r.max_active} at once), peak {r.peak_pages} pages of "
          f"{common.PAGE_SIZE}")
    print(f"prefill {r.prefill_s:.2f} s; decode {r.decode_tokens} tokens in {r.decode_s:.2f} s "
          f"({r.tokens_per_s:.1f} tokens/s)")
    print(f"K/V read in decode: DeFT {r.kv_bytes_deft / 2**20:,.0f} MiB, per-branch decoding "
          f"{r.kv_bytes_per_branch / 2**20:,.0f} MiB ({r.kv_ratio:.1f}x less)")


def _task_trace(task: str, workloads: str | None) -> Path:
    """The trace file of reasoning task ``task`` under the recorded workloads."""
    from ..recorded import workloads_dir

    try:
        folder = workloads_dir(workloads) / "deft" / "reasoning"
    except FileNotFoundError as exc:
        raise CliError(f"TRACE {task!r}: a task name needs the recorded workloads, and {exc}; "
                       "set DEFT_WORKLOADS, pass --workloads DIR or a trace file") from exc
    path = folder / f"{task}.json"
    if not path.is_file():
        known = ", ".join(sorted(p.stem for p in folder.glob("*.json"))) or "none"
        raise CliError(f"TRACE {task!r}: no such task in {folder} (there: {known})")
    return path
