"""Cache work per decode step where claims are hard to keep (CPU): the page allocator's owners
on a fragmented pool, and owners whose expectations add up to more than the pool holds.

``fragmented``: a pool of 32,768 pages of 16 slots with every other page in use, then 256
sequences decoding a token each per step (64 steps); none finds a run, so each new page is
a fresh search for one. ``over-expected``: 16,384 pages, 128 sequences with 64-token prompts,
each expecting 4,096 tokens (256 pages: twice the pool in all), decoding a token each per
step (256 steps); claims must give way to other sequences' pages. Each with expectations
(``TreeKVCache.expect``) and without; prints ms of cache work per step (``append`` of every
sequence's token, best of ``--repeats``) and how many runs of consecutive slots a sequence's
K/V lie in at the end (mean).

Usage: python tools/claims_cost.py [--repeats N]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np  # noqa: E402

from deft.cache import TreeKVCache  # noqa: E402


def fragmented(expect: bool) -> tuple[float, float]:
    c = TreeKVCache(32768, 16)
    for r in [c.add_root(16) for _ in range(32768)][::2]:
        c.prune(r)
    return decode(c, 256, 0, 4000 if expect else 0, 64)


def over_expected(expect: bool) -> tuple[float, float]:
    return decode(TreeKVCache(16384, 16), 128, 64, 4096 if expect else 0, 256)


def decode(c: TreeKVCache, seqs: int, prompt: int, expect: int, steps: int) -> tuple[float, float]:
    """ms per step of ``steps`` one-token appends to each of ``seqs`` new sequences (a
    ``prompt`` each first), and the mean runs of consecutive slots per sequence."""
    nodes = []
    for _ in range(seqs):
        n = c.add_root(0)
        if expect:
            c.expect(n, expect)
        c.append(n, max(prompt, 1))
        nodes.append(n)
    t0 = time.perf_counter()
    for _ in range(steps):
        for n in nodes:
            c.append(n, 1)
    ms = 1e3 * (time.perf_counter() - t0) / steps
    runs = [1 + int(np.count_nonzero(np.diff(c.slots(n)) != 1)) for n in nodes]
    return ms, sum(runs) / len(runs)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=3, help="runs of each, best kept (default 3)")
    a = ap.parse_args()
    print("| pool | expectations | ms of cache work per step | runs per sequence |")
    print("| --- | --- | --- | --- |")
    for name, case in (("fragmented", fragmented), ("over-expected", over_expected)):
        for expect in (False, True):
            got = [case(expect) for _ in range(max(a.repeats, 1))]
            print(f"| {name} | {'yes' if expect else 'no'} | {min(ms for ms, _ in got):.3f} "
                  f"| {got[0][1]:.1f} |", flush=True)


if __name__ == "__main__":
    main()
