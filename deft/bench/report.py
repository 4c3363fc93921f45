"""Plain-text tables for benchmark output (Markdown, so they paste into docs)."""

from __future__ import annotations

from typing import Any, Sequence

__all__ = ["markdown_table"]


def _fmt(x: Any) -> str:
    if isinstance(x, float):
        if x != x:
            return "–"
        return f"{x:.3g}" if abs(x) < 100 else f"{x:,.0f}"
    return str(x)


def markdown_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    cells = [[_fmt(c) for c in r] for r in rows]
    widths = [max(len(h), *(len(r[i]) for r in cells)) if cells else len(h) for i, h in enumerate(headers)]
    line = lambda r: "| " + " | ".join(c.ljust(w) for c, w in zip(r, widths)) + " |"  # noqa: E731
    sep = "| " + " | ".join("-" * w for w in widths) + " |"
    return "\n".join([line(headers), sep, *(line(r) for r in cells)])
