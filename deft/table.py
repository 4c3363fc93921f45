"""Markdown tables for command output (the demo, benchmark reports), so they paste into docs."""

from __future__ import annotations

from typing import Any, Sequence

__all__ = ["format_cell", "markdown_table"]


def format_cell(x: Any) -> str:
    """A float to 3 significant digits (thousands separated from 100 on), NaN as "–"."""
    if isinstance(x, float):
        if x != x:
            return "–"
        return f"{x:.3g}" if abs(x) < 100 else f"{x:,.0f}"
    return str(x)


def markdown_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A Markdown table with columns padded to their widest cell."""
    cells = [[format_cell(c) for c in r] for r in rows]
    widths = [max(len(h), *(len(r[i]) for r in cells)) if cells else len(h) for i, h in enumerate(headers)]
    line = lambda r: "| " + " | ".join(c.ljust(w) for c, w in zip(r, widths)) + " |"  # noqa: E731
    sep = "| " + " | ".join("-" * w for w in widths) + " |"
    return "\n".join([line(headers), sep, *(line(r) for r in cells)])
