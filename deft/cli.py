"""The ``deft`` command: demo and benchmarks."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Sequence

__all__ = ["main", "build_parser"]


class CliError(Exception):
    """A user error: printed as one line, exit code 2."""


def _workloads(path: str | None) -> Path | None:
    from .workloads import workloads_dir

    try:
        return workloads_dir(path)
    except FileNotFoundError as exc:
        if path is not None:
            raise CliError(str(exc)) from exc
        print(f"note: {exc}; recorded workloads are skipped", file=sys.stderr)
        return None


def cmd_demo(args: argparse.Namespace) -> None:
    from .demo import attention_demo

    print(attention_demo())


def cmd_bench_plan(args: argparse.Namespace) -> None:
    from .bench.plan_bench import plan_table

    print(plan_table(args.workload or None, _workloads(args.workloads), args.block_kv, args.reps))


def cmd_bench_attention(args: argparse.Namespace) -> None:
    import torch

    if args.device == "cuda":
        if not torch.cuda.is_available():
            raise CliError("--device cuda: no CUDA device is available")
        from .bench.gpu_bench import gpu_attention_report

        print(gpu_attention_report(args.workload or None, _workloads(args.workloads),
                                   out=args.out, progress=_progress))
        return
    from .bench.attention_bench import cpu_attention_table

    print(cpu_attention_table(args.workload or None, _workloads(args.workloads),
                              flex=not args.no_flex, reps=args.reps, progress=_progress))


def _progress(msg: str) -> None:
    print(f"  ... {msg}", file=sys.stderr, flush=True)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="deft",
        description="DeFT: exact, IO-aware attention for tree-structured LLM decoding.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    demo = sub.add_parser("demo", help="run the main demo on CPU",
                          description="Run DeFT on a few-shot tree (4,000-token prompt, 20 "
                          "branches of 200 tokens), check it against dense attention, and "
                          "compare the KV bytes read with per-query decoding.")
    demo.set_defaults(func=cmd_demo)

    bench = sub.add_parser("bench", help="benchmarks (plan, attention)")
    bsub = bench.add_subparsers(dest="bench", required=True, metavar="BENCH")
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--workloads", metavar="DIR",
                        help="recorded workloads directory (default: $DEFT_WORKLOADS or ../shared/workloads)")
    common.add_argument("--workload", action="append", metavar="NAME",
                        help="run only this workload (repeatable); see deft.bench.trees.WORKLOADS")

    plan = bsub.add_parser("plan", parents=[common], help="planning time per plan kind",
                           description="Median planning time of every plan kind on the benchmark trees.")
    plan.add_argument("--block-kv", type=int, default=64, help="tile size in tokens (default 64)")
    plan.add_argument("--reps", type=int, default=50, help="timed repetitions (default 50)")
    plan.set_defaults(func=cmd_bench_plan)

    att = bsub.add_parser("attention", parents=[common], help="DeFT against tree-attention peers",
                          description="One layer (cpu) or a 32-layer decode step (cuda) of "
                          "Llama-3-8B-shaped attention: DeFT against per-query decoding, SDPA "
                          "and FlexAttention, measured side by side in one process.")
    att.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    att.add_argument("--reps", type=int, default=10, help="timed repetitions on CPU (default 10)")
    att.add_argument("--no-flex", action="store_true", help="skip FlexAttention (its compile is slow)")
    att.add_argument("--out", metavar="DIR", help="(cuda) also write JSON details here")
    att.set_defaults(func=cmd_bench_attention)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        args.func(args)
    except CliError as exc:
        print(f"deft: error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
