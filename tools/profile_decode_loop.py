"""Where a whole decode loop's time goes, beyond the replayed graphs: the engine's steady
decode steps on a Llama-3-8B-shaped model (random bf16 weights, as ``deft bench e2e --device
cuda``) under ``torch.profiler``, per step: wall time, GPU busy time (the union of kernels
and copies), the replayed graph's share, the kernels and copies outside the graph (by name:
sampling, input copies, index writes), and the idle gaps, the largest with the GPU work on
either side (a gap after a copy to the host is the GPU waiting for the host's next step).

The replays are found as runs of the last graph's kernels in the stream. Steps: ``greedy``
(one sequence on a 1,000-token prompt), ``b=20`` (20 sampled branches on a 4,000-token
prompt). Each runs once to capture its graphs, then again under the profiler; the first
``SKIP`` decode steps of the profiled run are left out.

Usage: python3 tools/profile_decode_loop.py [STEP ...]   (GPU only)
"""
from collections import defaultdict

import torch
from torch.profiler import ProfilerActivity, profile

from deft.engine import SamplingParams, TreeEngine, generate, sample
from deft.model.synthetic import load_random
from _usage import args

NEW, SKIP = 24, 4
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
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            run(engine, step, prompt)
            torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as one:
            engine.graphs.last_graph.replay()
            torch.cuda.synchronize()
        graph = [e.name for e in gpu_events(one)]
        events = gpu_events(prof)
        names = [e.name for e in events]
        # The graph's kernels run back to back in the stream: find each replay as a run of
        # its names, and start after the first SKIP replays.
        replays = [i for i in range(len(names) - len(graph) + 1)
                   if names[i] == graph[0] and names[i:i + len(graph)] == graph]
        if len(replays) <= SKIP:
            raise SystemExit(f"{step}: {len(replays)} replays of the last graph found")
        first, k = replays[SKIP], len(replays) - SKIP
        in_graph = {j for i in replays[SKIP:] for j in range(i, i + len(graph))}
        events = events[first:]
        busy, gaps, cover, prev = 0.0, [], events[0].time_range.start, events[0]
        graph_us, outside = 0.0, defaultdict(lambda: [0, 0.0])
        for j, e in enumerate(events, first):
            s, t = e.time_range.start, e.time_range.end
            if s > cover:
                gaps.append((s - cover, prev.name, e.name))
            busy += max(0.0, t - max(s, cover))
            if t > cover:
                cover, prev = t, e
            if j in in_graph:
                graph_us += t - s
            else:
                outside[e.name][0] += 1
                outside[e.name][1] += t - s
        span = cover - events[0].time_range.start
        print(f"\n{step}: {k} steps, µs per step: wall {span / k:.0f}, GPU busy {busy / k:.0f}, "
              f"idle {sum(g for g, _, _ in gaps) / k:.0f} in {len(gaps) / k:.1f} gaps; "
              f"{len(graph)} kernels of the graph, {graph_us / k:.0f} µs of kernel time")
        print("  outside the graph (per step: count, µs):")
        for name, (n, us) in sorted(outside.items(), key=lambda kv: -kv[1][1]):
            print(f"    {n / k:5.1f} {us / k:8.1f}  {name[:90]}")
        print("  largest gaps (µs, after, before):")
        for g, a, b in sorted(gaps, reverse=True)[:8]:
            print(f"    {g:8.1f}  {a[:50]}  ->  {b[:50]}")


if __name__ == "__main__":
    main(args(__doc__) or ["greedy", "b=20"])
