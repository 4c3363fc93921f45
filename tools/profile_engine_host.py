"""Where a decode loop's host time goes when the host is on the critical path: beam search
and draft-tree verification wait for each step's scores before they build the next step.
Runs the loop of ``deft bench e2e --device cuda`` (Llama-3-8B shapes, random bf16 weights)
once to warm up, then for 32 steps and for one, timed (best of three) and under cProfile,
and prints the difference per step (so the prompt's prefill drops out): wall ms, and the top
functions by own time. Then the critical path of 32 steps without the profiler: CUDA events
around each replayed step and before each step's wait for its scores give the GPU's time in
the replay (input copy, graph, output copy), after it (scores, picks) and idle; host clock
stamps split the host's time from the end of that wait to the next replay by phase (the
decode loop's own work, the engine's checks and slots, the layout, the plan and its upload,
the replay's launch). It says whether planning is compiled: run it where the package's
extensions were built (``python3 setup.py build_ext --inplace`` in the same call on a lent
machine).

Loops: ``beam16`` (beam search k=16 from a 2,000-token prompt), ``beam4`` (k=4), ``t=256``
(verifying Medusa's APPS-256 tree on a 4,000-token prompt; needs the recorded
workloads, ``$DEFT_WORKLOADS``, else ``../shared/workloads``).

Usage: python3 tools/profile_engine_host.py [LOOP ...]   (GPU only)
"""
import cProfile
import pstats
import time
from contextlib import contextmanager
from pathlib import Path

import torch

from benchmarks.e2e_gpu import GPU_WORKLOADS, run_workload
from benchmarks.trees import apps_tree, medusa_parents
from deft.engine import TreeEngine, core
from deft.engine.runner import ModelRunner
from deft.model.synthetic import load_random
from deft.plan.compiled import load_library
from deft.recorded import workloads_dir
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
        parents = medusa_parents(apps_tree(w.width, workloads_dir()))
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


# The host's phases from the end of a step's wait for its scores to the next replay's
# launch, each named by the stamp that ends it.
PHASES = {"forward": "decode loop (scores, tree)", "layout": "engine checks, slots",
          "built": "layout", "run": "engine, to the runner", "plan": "runner, to the plan",
          "planned": "graph plan and upload", "replay": "runner, to the replay",
          "launched": "replay launch"}


@contextmanager
def stamped(engine: TreeEngine):
    """Patches that record host stamps ``(name, seconds)`` at each phase's end and CUDA
    events at each replay's start and end and before each wait of the host for the GPU
    (``tolist`` of a CUDA tensor); yields the two lists, undone on exit."""
    stamps, events = [], []
    graphs = engine.runner.graphs

    def mark(name):
        stamps.append((name, time.perf_counter()))

    def event(name):
        e = torch.cuda.Event(enable_timing=True)
        e.record()
        events.append((name, e))

    def wrap(fn, before, after=None):
        def wrapped(*a, **k):
            mark(before)
            out = fn(*a, **k)
            if after is not None:
                mark(after)
            return out
        return wrapped

    def replay(b, step, _orig=graphs.replay):
        mark("replay")
        event("start")
        out = _orig(b, step)
        event("end")
        mark("launched")
        return out

    def tolist(self, _orig=torch.Tensor.tolist):
        if self.device.type != engine.device.type:  # not a wait for the device
            return _orig(self)
        event("wait")
        out = _orig(self)
        mark("synced")
        return out

    own = "tolist" in vars(torch.Tensor)
    saved = (TreeEngine.forward, core.build_step, ModelRunner.run, torch.Tensor.tolist)
    TreeEngine.forward = wrap(TreeEngine.forward, "forward")
    core.build_step = wrap(core.build_step, "layout", "built")
    ModelRunner.run = wrap(ModelRunner.run, "run")
    graphs.plan = wrap(graphs.plan, "plan", "planned")
    graphs.replay = replay
    torch.Tensor.tolist = tolist
    try:
        yield stamps, events
    finally:
        TreeEngine.forward, core.build_step, ModelRunner.run = saved[:3]
        if own:
            torch.Tensor.tolist = saved[3]
        else:
            del torch.Tensor.tolist
        del graphs.plan, graphs.replay


def critical_path(engine: TreeEngine, run, steps: int) -> dict[str, float]:
    """ms per steady step of ``run(steps)``: wall (from one wait's end to the next, over
    the waits a replay follows), the GPU's time in the replay, after it and before the next
    (idle but for the copy of the scores to the host and the plan's upload), and the host's
    :data:`PHASES` between a wait's end and the next replay's launch."""
    with stamped(engine) as (stamps, events):
        run(steps)
        torch.cuda.synchronize()
    gpu = dict.fromkeys(("GPU: replayed step", "GPU: after it", "GPU: before the next"), 0.0)
    kinds = [name for name, _ in events]
    steady = 0
    for i in range(len(events) - 3):  # a wait, a replay's start and end, the next wait
        if kinds[i:i + 4] == ["wait", "start", "end", "wait"]:
            (_, w0), (_, a), (_, b), (_, w1) = events[i:i + 4]
            gpu["GPU: before the next"] += w0.elapsed_time(a)
            gpu["GPU: replayed step"] += a.elapsed_time(b)
            gpu["GPU: after it"] += b.elapsed_time(w1)
            steady += 1
    host = dict.fromkeys(PHASES.values(), 0.0)
    walls, synced, prev = [], None, None  # prev: the last stamp of the open window
    window: dict[str, float] = {}  # its phases: counted once a replay closes it
    for name, t in stamps:
        if name == "synced":
            if synced is not None and prev is None:  # a replay was launched since
                walls.append(t - synced)
                for k, v in window.items():
                    host[k] += v
            synced, prev, window = t, t, {}
        elif prev is not None and name in PHASES:
            window[PHASES[name]] = window.get(PHASES[name], 0.0) + t - prev
            prev = None if name == "launched" else t
    out = {"ms/step (wait to wait)": 1e3 * sum(walls) / max(len(walls), 1)}
    out.update({k: v / max(steady, 1) for k, v in gpu.items()})  # elapsed_time is in ms
    out.update({f"host: {k}": 1e3 * v / max(len(walls), 1) for k, v in host.items()})
    out["steps"] = min(steady, len(walls))
    return out


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
        path = critical_path(engine, run, STEPS)
        print(f"\n== {name}: the critical path of {path.pop('steps')} steady steps, ms per step "
              "(events and clock stamps, no profiler):")
        for what, ms in path.items():
            print(f"  {ms:8.3f}  {what}")


if __name__ == "__main__":
    main(args(__doc__))
