"""The ``deft`` command: generation (generate, sample, beam, speculate), trace replay, the
demo and benchmarks, one module per command group over :mod:`.common`."""

from __future__ import annotations

import sys
from typing import Sequence

from . import bench, demo, generate, replay, serve, speculate
from .common import CliError, Parser, choose_device, printable

__all__ = ["CliError", "build_parser", "main"]


def build_parser() -> Parser:
    parser = Parser(
        prog="deft",
        description="DeFT: exact, IO-aware attention for tree-structured LLM decoding.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    generate.add_parsers(sub)
    speculate.add_parser(sub)
    replay.add_parser(sub)
    demo.add_parser(sub)
    bench.add_parser(sub)
    serve.add_parser(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    prog = parser._command(args).prog  # errors name the command, as argument errors do
    choose_device(args)
    try:
        args.func(args)
    except CliError as exc:
        print(printable(f"{prog}: error: {exc}"), file=sys.stderr)
        return 2
    except RuntimeError as exc:
        group = sys.modules.get("deft.distributed.group")  # only loaded under --tp
        if group is None or not isinstance(exc, group.TensorParallelError):
            raise
        print(printable(f"{prog}: error: {exc}"), file=sys.stderr)
        return 1
    return 0
