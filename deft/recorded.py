"""The recorded workload files: where they are, Medusa draft-tree choices, reasoning traces.

The files live outside the repository (``../shared/workloads`` beside the checkout, or a
directory named by ``DEFT_WORKLOADS`` or passed explicitly); they are read, never copied.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

__all__ = ["workloads_dir", "load_medusa_choices", "load_reasoning_records"]

# The directory holding the deft package: the checkout for a source or editable install.
_CHECKOUT = Path(__file__).resolve().parents[1]


def workloads_dir(path: str | os.PathLike[str] | None = None) -> Path:
    """The recorded-workloads directory: ``path``, else ``$DEFT_WORKLOADS``, else
    ``shared/workloads`` beside the deft checkout (found from any working directory), else
    beside the working directory. ``FileNotFoundError`` names each place tried once.
    """
    given = path if path is not None else os.environ.get("DEFT_WORKLOADS") or None
    if given is not None:
        p = Path(given)
        if p.is_dir():
            return p
        source = "" if path is not None else "DEFT_WORKLOADS="
        raise FileNotFoundError(f"recorded workloads not found: {source}{p} is not a directory")
    tried: list[str] = []
    for p in (_CHECKOUT.parent / "shared" / "workloads", Path.cwd().parent / "shared" / "workloads"):
        if p.is_dir():
            return p
        if str(p) not in tried:
            tried.append(str(p))
    raise FileNotFoundError("recorded workloads not found (tried " + " and ".join(tried)
                            + "); set DEFT_WORKLOADS to their directory or pass it")


def load_medusa_choices(path: str | os.PathLike[str]) -> Any:
    """Draft-tree paths from a Medusa choices file (``Tree_Structure`` or ``paths`` key), as
    stored: :meth:`deft.engine.TreeShape.from_choices` checks them."""
    with open(path) as f:
        try:
            data = json.load(f)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path}: not JSON ({exc})") from None
    for key in ("Tree_Structure", "paths"):
        if isinstance(data, dict) and key in data:
            return data[key]
    raise ValueError(f"{path}: expected a JSON object with 'Tree_Structure' or 'paths'")


def load_reasoning_records(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """The complete records of a reasoning-trace file (a JSON list; ``incompleted`` ones dropped)."""
    with open(path) as f:
        records = json.load(f)
    if not isinstance(records, list):
        raise TypeError(f"expected a JSON list of records, got {type(records).__name__}")
    return [r for r in records if not r.get("incompleted")]
