"""Where a whole decode loop's time goes, beyond the replayed graphs: the engine's steady
decode steps on a Llama-3-8B-shaped model (random bf16 weights, as ``deft bench e2e --device
cuda``) under ``torch.profiler``, per step: wall time, GPU busy time (the union of kernels
and copies), the replayed graph's share, the kernels and copies outside the graph (by name:
sampling, input copies, index writes), and the idle gaps, the largest with the GPU work on
either side (a gap after a copy to the host is the GPU waiting for the host's next step).

Steps: ``greedy`` (one sequence on a 1,000-token prompt), ``b=20`` (20 sampled branches on a
4,000-token prompt). Each runs once to capture its graphs, then again under the profiler;
the first ``SKIP`` decode steps of the profiled run are left out.

Usage: python3 tools/profile_decode_loop.py [STEP ...]   (GPU only)
"""
import sys
from collections import Counter, defaultdict

import torch
from torch.profiler import ProfilerActivity, profile

from deft.engine import SamplingParams, TreeEngine, generate, sample
from deft.model.synthetic import load_random

NEW, SKIP, REPLAYS = 24, 4, 10
CUDA = torch.autograd.DeviceType.CUDA


def run(engine: TreeEngine, step: str, prompt: list[int]) -> None:
    params = SamplingParams(max_new_tokens=NEW, stop_token_ids=frozenset())
    if step == "greedy":
        generate(engine, prompt[:1000], params)
    elif step == "b=20":
        sample(engine, prompt, 20, SamplingParams(max_new_tokens=NEW, temperature=1.0, seed=0,
                                                  stop_token_ids=frozenset()))
    else:
        raise SystemExit(f"unknown step {step!r}: expected greedy or b=20")


def gpu_events(prof) -> list:
    return sorted((e for e in prof.events() if e.device_type == CUDA),
                  key=lambda e: e.time_range.start)


def main(steps: list[str]) -> None:
    model, tok = load_random("random:llama-3-8b", "cuda")
    engine = TreeEngine(model, tok, num_pages=4096)
    prompt = torch.randint(0, model.config.vocab_size, (4000,),
                           generator=torch.Generator().manual_seed(0)).tolist()
    for step in steps:
        run(engine, step, prompt)  # captures this step's graphs
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            run(engine, step, prompt)
            torch.cuda.synchronize()
        launches = sorted(e.time_range.start for e in prof.events()
                          if e.device_type != CUDA and e.name == "cudaGraphLaunch")
        with profile(activities=[ProfilerActivity.CUDA]) as one:
            for _ in range(REPLAYS):
                engine.graphs.last_graph.replay()
            torch.cuda.synchronize()
        in_graph = Counter(e.name for e in gpu_events(one))
        events = [e for e in gpu_events(prof) if e.time_range.start >= launches[SKIP]]
        k = sum(1 for t in launches if t >= launches[SKIP])
        busy, gaps, cover, prev = 0.0, [], events[0].time_range.start, events[0]
        seen, spent = Counter(), defaultdict(float)
        for e in events:
            s, t = e.time_range.start, e.time_range.end
            if s > cover:
                gaps.append((s - cover, prev.name, e.name))
            busy += max(0.0, t - max(s, cover))
            if t > cover:
                cover, prev = t, e
            seen[e.name] += 1
            spent[e.name] += t - s
        # What the graphs do not hold, at the mean duration of that name's events.
        outside = {n: (c - in_graph[n] * k / REPLAYS, spent[n] / c) for n, c in seen.items()
                   if c > in_graph[n] * k / REPLAYS + 0.5}
        span = cover - events[0].time_range.start
        print(f"\n{step}: {k} steps, µs per step: wall {span / k:.0f}, GPU busy {busy / k:.0f}, "
              f"idle {sum(g for g, _, _ in gaps) / k:.0f} in {len(gaps) / k:.1f} gaps")
        print("  outside the graph (per step: count, µs):")
        for name, (n, mean) in sorted(outside.items(), key=lambda kv: -kv[1][0] * kv[1][1]):
            print(f"    {n / k:5.1f} {n * mean / k:8.1f}  {name[:90]}")
        print("  largest gaps (µs, after, before):")
        for g, a, b in sorted(gaps, reverse=True)[:8]:
            print(f"    {g:8.1f}  {a[:50]}  ->  {b[:50]}")


if __name__ == "__main__":
    main(sys.argv[1:] or ["greedy", "b=20"])
