"""A benchmark's output: its Markdown table, and its result record stored as JSON.

A record holds where and how it was measured (``gpu`` or ``device``, ``commit``, ``date``,
``command``, versions) and its table as ``rows``, a list of dicts whose keys are the column
headers in order; further tables of the same run may sit under other keys (lists of dicts).
``benchmarks/results/`` keeps the current ones; ``python -m benchmarks.render`` draws them.
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any, Sequence

import torch

from deft.table import format_cell, markdown_table

__all__ = ["REQUIRED_KEYS", "append_record", "check_record", "current_commit", "dumps_record",
           "format_cell", "join_records", "load_record", "markdown_table", "record",
           "rows_as_dicts", "write_record"]

# Besides one of "gpu" (a GPU run) or "device" (a CPU run).
REQUIRED_KEYS = ("commit", "date", "command", "rows")


def rows_as_dicts(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> list[dict[str, Any]]:
    """Table rows as dicts keyed by header; NaN (a missing figure) becomes ``None``."""
    return [{h: (None if isinstance(c, float) and c != c else c) for h, c in zip(headers, r)}
            for r in rows]


def current_commit() -> str:
    """The checkout's short commit, ``-dirty`` when it has changes; "unknown" outside git."""
    root = Path(__file__).resolve().parent.parent
    try:
        out = subprocess.run(["git", "describe", "--always", "--dirty", "--abbrev=7"], cwd=root,
                             capture_output=True, text=True, timeout=10, check=True)
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return out.stdout.strip() or "unknown"


def _command() -> str:
    """The command line of this process (``deft bench ...``, ``python -m benchmarks.x ...``)."""
    prog = Path(sys.argv[0]).name if sys.argv and sys.argv[0] else "python"
    if prog == "__main__.py" or prog.endswith(".py"):
        spec = getattr(sys.modules.get("__main__"), "__spec__", None)
        prog = f"python -m {spec.name}" if spec is not None else f"python {sys.argv[0]}"
    return " ".join([prog, *map(shlex.quote, sys.argv[1:])])


def record(headers: Sequence[str], rows: Sequence[Sequence[Any]], device: str = "cpu",
           **extra: Any) -> dict[str, Any]:
    """The result record of a run of this process on ``device`` ("cpu" or "cuda"): the
    machine, commit, UTC date, command line and versions, then ``extra`` and the rows."""
    rec: dict[str, Any] = {}
    if device == "cuda":
        rec["gpu"] = torch.cuda.get_device_name()
    else:
        rec["device"] = f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores"
    rec.update(commit=current_commit(),
               date=datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
               command=_command(), python=platform.python_version(), torch=torch.__version__)
    try:
        import triton
    except ImportError:
        pass
    else:
        rec["triton"] = triton.__version__
    rec["planner"] = _planner()
    rec.update(extra)
    rec["rows"] = rows_as_dicts(headers, rows)
    return rec


def _planner() -> str:
    """Which DeFT-Flatten planner this process plans with: a record made with the numpy
    fallback (an install without the compiled extension) has slower host steps."""
    import warnings

    from deft.plan.compiled import load_library

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        return "compiled" if load_library() is not None else "numpy"


def check_record(rec: Any, name: str = "record") -> None:
    """``ValueError`` naming what a result record lacks."""
    if not isinstance(rec, dict):
        raise ValueError(f"{name}: expected a JSON object, got {type(rec).__name__}")
    missing = [k for k in REQUIRED_KEYS if k not in rec]
    if "gpu" not in rec and "device" not in rec:
        missing.append("gpu or device")
    if missing:
        raise ValueError(f"{name}: missing keys {', '.join(missing)}")
    for key, table in rec.items():
        if key == "rows" or (isinstance(table, list) and table and isinstance(table[0], dict)):
            if not isinstance(table, list) or not all(isinstance(r, dict) for r in table):
                raise ValueError(f"{name}: {key!r} must be a list of objects (one per row)")


def dumps_record(rec: dict[str, Any]) -> str:
    """``rec`` as JSON with one line per key and per table row (short diffs, easy to read)."""
    def value(v: Any) -> str:
        if isinstance(v, list) and v and all(isinstance(r, dict) for r in v):
            return "[\n" + ",\n".join("  " + json.dumps(r, ensure_ascii=False) for r in v) + "\n ]"
        return json.dumps(v, ensure_ascii=False)

    return "{\n" + ",\n".join(f" {json.dumps(k)}: {value(v)}" for k, v in rec.items()) + "\n}\n"


def write_record(path: str | os.PathLike[str], rec: dict[str, Any]) -> None:
    """Write ``rec`` as JSON (parent directories made as needed)."""
    check_record(rec, str(path))
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(dumps_record(rec))


def _is_rows(value: Any) -> bool:
    """Whether ``value`` is a table: a list of rows (dicts), maybe empty."""
    return isinstance(value, list) and all(isinstance(r, dict) for r in value)


def join_records(first: dict[str, Any], then: dict[str, Any]) -> dict[str, Any]:
    """One record of runs of the same machine and commit (trees run in separate processes):
    ``first`` (one run or several joined) and the run ``then``. Tables' rows in run order,
    the dates joined by "and", the commands by "; then"; a value the runs measured
    differently (a process's HBM throughput) becomes the list of every run's, in order.
    ``ValueError`` for runs of other machines or commits."""
    for key in ("gpu", "device", "commit"):
        if first.get(key) != then.get(key):
            raise ValueError(f"the record holds a run of {key} {first.get(key)!r}, this run's "
                             f"is {then.get(key)!r}: a record is one machine's and one commit's")
    runs = first["command"].count("; then ") + 1  # in ``first``
    joined = dict(first)
    for key, value in then.items():
        old = joined.get(key)
        if key not in joined:
            joined[key] = value
        elif key == "command":
            joined[key] = f"{old}; then {value}"
        elif key == "date":
            joined[key] = old if value in old.split(" and ") else f"{old} and {value}"
        elif _is_rows(old) and _is_rows(value):
            joined[key] = old + value
        elif isinstance(old, list):  # already one value per run
            joined[key] = old + [value]
        elif old != value:
            joined[key] = [old] * runs + [value]
    return joined


def append_record(path: str | os.PathLike[str], rec: dict[str, Any]) -> None:
    """Join ``rec`` to the record at ``path`` (:func:`join_records`), or write it there if
    there is none yet (an empty file is none). Runs that append to one path at once take
    turns: each holds an exclusive lock on the file (``flock``) from its read to its write,
    so none loses another's rows; a join or serialisation that fails leaves the file as it
    was."""
    import fcntl

    check_record(rec, str(path))
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a+", encoding="utf-8") as f:
        fcntl.flock(f, fcntl.LOCK_EX)  # released when the file closes
        f.seek(0)
        old = f.read()
        if old:
            rec = join_records(_parse_record(old, path), rec)
        text = dumps_record(rec)  # before the file is cut
        f.seek(0)
        f.truncate()
        f.write(text)


def record_commit(path: str | os.PathLike[str]) -> str | None:
    """The commit of the record at ``path``, read under a shared lock (not while a run
    appends to it, :func:`append_record`); ``None`` for an empty file. ``ValueError`` for a
    file that holds no record."""
    import fcntl

    with open(path, encoding="utf-8") as f:
        fcntl.flock(f, fcntl.LOCK_SH)
        text = f.read()
    return _parse_record(text, path)["commit"] if text else None


def load_record(path: str | os.PathLike[str]) -> dict[str, Any]:
    """A stored result record, checked."""
    return _parse_record(Path(path).read_text(), path)


def _parse_record(text: str, path: str | os.PathLike[str]) -> dict[str, Any]:
    """The record stored as ``text`` in the file at ``path``, checked."""
    rec = json.loads(text)
    check_record(rec, str(path))
    return rec
