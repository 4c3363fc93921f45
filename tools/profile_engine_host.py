"""Where a decode loop's host time goes when the host is on the critical path: beam search
and draft-tree verification wait for each step's scores before they build the next step.
Runs the loop of ``deft bench e2e --device cuda`` (Llama-3-8B shapes, random bf16 weights)
once to warm up, then for 32 steps and for one, timed (best of three) and under cProfile,
and prints the difference per step (so the prompt's prefill drops out): wall ms, and the top
functions by own time. It says whether planning is compiled: run it where the package's
extensions were built (``python3 setup.py build_ext --inplace`` in the same call on a lent
machine).

Loops: ``beam16`` (beam search k=16 from a 2,000-token prompt), ``beam4`` (k=4), ``t=256``
(verifying Medusa's APPS-256 tree on a 4,000-token prompt; needs ``$DEFT_WORKLOADS``,
default ``.workloads``).

Usage: python3 tools/profile_engine_host.py [LOOP ...]   (GPU only)
"""
import cProfile
import os
import pstats
import time
from pathlib import Path

import torch

from benchmarks.e2e_gpu import GPU_WORKLOADS, run_workload
from benchmarks.trees import apps_tree, medusa_parents
from deft.engine import TreeEngine
from deft.model.synthetic import load_random
from deft.plan.compiled import load_library
from _usage import args

STEPS = 32


LOOPS = {"beam16": "beam k=16", "beam4": "beam k=4", "t=256": "Medusa APPS-256 verify"}


def loop(engine: TreeEngine, name: str, gen: torch.Generator):
    """A callable running ``steps`` steps of loop ``name`` (the benchmark's workload), its
    prompt fed first."""
    if name not in LOOPS:
        raise SystemExit(f"unknown loop {name!r}: expected {', '.join(LOOPS)}")
    w = next(w for w in GPU_WORKLOADS if w.name == LOOPS[name])
    prompt = torch.randint(0, engine.vocab_size, (w.prompt,), generator=gen).tolist()
    parents = None
    if w.kind == "verify":
        parents = medusa_parents(apps_tree(w.width, Path(os.environ.get("DEFT_WORKLOADS", ".workloads"))))
    return lambda steps: run_workload(engine, w, [prompt], steps, parents, None)()


def timed(run, steps: int, profiled: bool) -> tuple[float, dict]:
    """Wall seconds of ``run(steps)`` (the GPU done) and, when ``profiled``, cProfile's stats."""
    prof = cProfile.Profile() if profiled else None
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    if prof is not None:
        prof.enable()
    run(steps)
    torch.cuda.synchronize()
    if prof is None:
        return time.perf_counter() - t0, {}
    prof.disable()
    return time.perf_counter() - t0, pstats.Stats(prof).stats


def main(argv: list[str]) -> None:
    model, tok = load_random("random:llama-3-8b", "cuda")
    engine = TreeEngine(model, tok, num_pages=4096)
    print(f"planner: {'compiled' if load_library() is not None else 'numpy'}")
    gen = torch.Generator().manual_seed(0)
    for name in argv or ["beam16", "t=256"]:
        run = loop(engine, name, gen)
        run(STEPS)  # compiles and captures what the timed runs replay
        # Runs of STEPS steps and of one (best of three each): their difference is STEPS - 1
        # steps, the prefill excluded.
        walls = [(timed(run, STEPS, False)[0], timed(run, 1, False)[0]) for _ in range(3)]
        per_step = (min(w for w, _ in walls) - min(w for _, w in walls)) / (STEPS - 1)
        many, one = timed(run, STEPS, True)[1], timed(run, 1, True)[1]
        print(f"\n== {name}: {1e3 * per_step:.2f} ms per step without the profiler; top functions "
              f"by own time, µs per step (own, cumulative, calls):")
        rows = []
        for key, (_, calls, own, cum, _) in many.items():
            _, calls1, own1, cum1, _ = one.get(key, (0, 0, 0.0, 0.0, None))
            rows.append((own - own1, cum - cum1, calls - calls1, key))
        for own, cum, calls, (file, line, func) in sorted(rows, key=lambda r: -r[0])[:25]:
            n = STEPS - 1
            print(f"  {1e6 * own / n:8.1f} {1e6 * cum / n:8.1f} {calls / n:6.1f}  "
                  f"{Path(file).name}:{line}({func})")


if __name__ == "__main__":
    main(args(__doc__))
