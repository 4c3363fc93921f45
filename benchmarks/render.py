"""Stored benchmark results (``benchmarks/results/*.json``) as Markdown tables, and into docs.

A doc marks where a result goes; ``--write`` fills the block between the markers::

    <!-- results:attention_h200 where="impl=DeFT-Flatten" columns="workload;% roofline" -->
    ...generated, do not edit...
    <!-- /results -->

Options (all optional): ``table`` (a record's table other than ``rows``, e.g. ``floors``),
``where="COLUMN=VALUE"`` (keep those rows), ``columns="A;B;..."`` (these columns, in this
order), ``pivot=COLUMN value=COLUMN [index=COLUMN]`` (one row per ``index`` value, default the
first column, one column per ``pivot`` value holding ``value``), ``meta=no`` (no line naming
the machine, commit, date and command above the table).

Usage: ``python -m benchmarks.render [NAME ...]`` prints each result (all by default);
``python -m benchmarks.render --write docs/benchmarks.md`` updates the doc's blocks;
``--check FILE`` exits with status 1 if they are out of date.
"""

from __future__ import annotations

import argparse
import re
import shlex
import sys
from pathlib import Path
from typing import Any, Sequence

from deft.table import markdown_table

__all__ = ["RESULTS", "render", "render_record", "update_text"]

RESULTS = Path(__file__).resolve().parent / "results"
_BLOCK = re.compile(r"(<!-- results:(\S+)(.*?)-->\n)(.*?)(<!-- /results -->)", re.S)
_OPTIONS = ("table", "where", "columns", "pivot", "value", "index", "meta")


def _load(name: str, results: Path) -> dict[str, Any]:
    from .report import load_record

    path = results / f"{name}.json"
    if not path.is_file():
        known = ", ".join(sorted(p.stem for p in results.glob("*.json")))
        raise ValueError(f"result {name!r}: no {path} (known: {known})")
    return load_record(path)


def _caption(rec: dict[str, Any]) -> str:
    versions = ", ".join(f"{k} {rec[k]}" for k in ("python", "torch", "triton", "transformers")
                         if k in rec)
    where = rec.get("gpu") or rec.get("device")
    return (f"*{where}, commit {rec['commit']}, {rec['date']}" + (f" ({versions})" if versions else "")
            + f": `{rec['command']}`*")


def render_record(rec: dict[str, Any], table: str = "rows", where: str | None = None,
                  columns: str | Sequence[str] | None = None, pivot: str | None = None,
                  value: str | None = None, index: str | None = None, meta: bool = True) -> str:
    """A result record's table as Markdown (options as in the module docstring)."""
    if table not in rec or not isinstance(rec[table], list):
        raise ValueError(f"table: expected one of the record's tables, got {table!r}")
    rows: list[dict[str, Any]] = rec[table]
    headers = list(dict.fromkeys(k for r in rows for k in r))
    if where is not None:
        col, sep, want = where.partition("=")
        if not sep or col not in headers:
            raise ValueError(f"where: expected COLUMN=VALUE with a column of {headers}, got {where!r}")
        rows = [r for r in rows if str(r.get(col)) == want]
    if pivot is not None:
        index = index or headers[0]
        for opt, col in (("pivot", pivot), ("value", value), ("index", index)):
            if col not in headers:
                raise ValueError(f"{opt}: expected a column of {headers}, got {col!r}")
        keys = list(dict.fromkeys(r[pivot] for r in rows))
        grouped: dict[Any, dict[str, Any]] = {}
        for r in rows:
            grouped.setdefault(r[index], {index: r[index]})[str(r[pivot])] = r[value]
        rows, headers = list(grouped.values()), [index, *map(str, keys)]
    if columns is not None:
        cols = columns.split(";") if isinstance(columns, str) else list(columns)
        unknown = [c for c in cols if c not in headers]
        if unknown:
            raise ValueError(f"columns: {unknown} not among {headers}")
        headers = cols
    cells = [[_cell(r.get(h)) for h in headers] for r in rows]
    body = markdown_table([_escape(h) for h in headers], cells)
    return f"{_caption(rec)}\n\n{body}" if meta else body


def _cell(x: Any) -> Any:
    if x is None:
        return float("nan")  # a missing figure renders as "–"
    return _escape(x) if isinstance(x, str) else x


def _escape(text: str) -> str:
    return text.replace("|", "\\|")  # a pipe inside a cell would split it


def render(name: str, results: Path = RESULTS, **options: Any) -> str:
    """The stored result ``name`` (``results/NAME.json``) as Markdown."""
    return render_record(_load(name, results), **options)


def _options(text: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for item in shlex.split(text):
        key, sep, val = item.partition("=")
        if not sep or key not in _OPTIONS:
            raise ValueError(f"results marker option: expected KEY=VALUE with KEY one of "
                             f"{', '.join(_OPTIONS)}, got {item!r}")
        out[key] = val.lower() not in ("no", "false", "0") if key == "meta" else val
    return out


def update_text(text: str, results: Path = RESULTS) -> str:
    """``text`` with every results block regenerated from the stored results."""
    def block(m: re.Match[str]) -> str:
        table = render(m.group(2), results, **_options(m.group(3)))
        return f"{m.group(1)}{table}\n{m.group(5)}"

    return _BLOCK.sub(block, text)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.render", description=__doc__.split("\n\n")[0])
    ap.add_argument("names", nargs="*", metavar="NAME", help="results to print (default: all)")
    ap.add_argument("--results", type=Path, default=RESULTS, help=f"results directory (default {RESULTS})")
    group = ap.add_mutually_exclusive_group()
    group.add_argument("--write", metavar="FILE", type=Path, help="regenerate FILE's results blocks")
    group.add_argument("--check", metavar="FILE", type=Path, help="exit 1 if FILE's blocks are stale")
    args = ap.parse_args(argv)
    try:
        if args.write or args.check:
            path = args.write or args.check
            text = path.read_text()
            new = update_text(text, args.results)
            if args.check:
                if new != text:
                    print(f"{path}: results blocks are out of date; run python -m benchmarks.render "
                          f"--write {path}", file=sys.stderr)
                    return 1
                return 0
            path.write_text(new)
            return 0
        names = args.names or sorted(p.stem for p in args.results.glob("*.json"))
        for name in names:
            rec = _load(name, args.results)
            print(f"## {name}" + (f": {rec['title']}" if rec.get("title") else "") + "\n")
            for table in ["rows", *(k for k, v in rec.items() if k != "rows" and isinstance(v, list)
                                    and v and isinstance(v[0], dict))]:
                print(render_record(rec, table=table, meta=table == "rows") + "\n")
    except (OSError, ValueError) as exc:
        print(f"python -m benchmarks.render: error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
