"""Median wall-clock timing of a callable (CPU) — a GPU timer lives with the GPU benchmark."""

from __future__ import annotations

import statistics
import time
from typing import Any, Callable

__all__ = ["median_plan_seconds", "median_seconds"]


def median_seconds(fn: Callable[[], object], reps: int = 20, warmup: int = 2,
                   max_seconds: float = 5.0) -> float:
    """Median of up to ``reps`` timed calls after ``warmup`` calls (stops early past ``max_seconds``)."""
    for _ in range(warmup):
        fn()
    times: list[float] = []
    start = time.perf_counter()
    while len(times) < reps and (len(times) < 3 or time.perf_counter() - start < max_seconds):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def median_plan_seconds(attn: Any, layout: Any, reps: int, warmup: int = 0) -> float:
    """Median of ``reps`` back-to-back ``attn.plan(layout)`` calls, each as the plan times
    itself (``attn.plan_seconds``), after ``warmup`` untimed ones."""
    times = []
    for i in range(warmup + reps):
        attn.plan(layout)
        if i >= warmup:
            times.append(attn.plan_seconds)
    return statistics.median(times)
