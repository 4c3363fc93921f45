"""Where a whole decode step's GPU time goes: the engine's last replayed step graph on a
Llama-3-8B-shaped model (random bf16 weights, as ``deft bench e2e --device cuda``), its
kernels timed by ``torch.profiler`` and grouped by kind, per step. A kernel launched early
(programmatic dependent launch: the merge waits inside for the partial kernel) overlaps the
one before; "own" time counts only what no earlier kernel covers, so the own times add up to
the step's span.

Steps: ``b=20`` (20 sampled branches on a 4,000-token prompt), ``greedy`` (one sequence on a
1,000-token prompt), ``t=256`` (verifying Medusa's APPS-256 tree on a 4,000-token prompt;
needs the recorded workloads, ``$DEFT_WORKLOADS``, else ``../shared/workloads``).

Usage: python3 tools/profile_engine_step.py [STEP ...] [--json PATH]
"""
import json
import re
from collections import defaultdict
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from benchmarks.trees import apps_tree, medusa_parents
from deft.engine import SamplingParams, TreeEngine, generate, sample
from deft.model.synthetic import load_random
from deft.recorded import workloads_dir
from _usage import args

REPLAYS = 20
KINDS = [("attention", r"tree_partial|merge_kernel"), ("matmul", r"gemm|gemv|cutlass|nvjet|xmma|splitK|skinny|gated"),
         ("norm", r"rms_norm"), ("rope + K/V write", r"rope_write"), ("SiLU·mul", r"silu_mul"),
         ("sampling", r"softmax|multinomial|sort|topk|exponential|argmax|max|cumsum|gather")]


def kind(name: str) -> str:
    return next((k for k, pat in KINDS if re.search(pat, name, re.I)), "other")


def run_step(engine: TreeEngine, step: str, gen: torch.Generator) -> None:
    vocab = engine.vocab_size
    if step == "b=20":
        prompt = torch.randint(0, vocab, (4000,), generator=gen).tolist()
        sample(engine, prompt, 20, SamplingParams(max_new_tokens=4, temperature=1.0, seed=0,
                                                  stop_token_ids=frozenset()))
    elif step == "greedy":
        prompt = torch.randint(0, vocab, (1000,), generator=gen).tolist()
        generate(engine, prompt, SamplingParams(max_new_tokens=4, stop_token_ids=frozenset()))
    elif step == "t=256":
        parents = medusa_parents(apps_tree(256, workloads_dir()))
        prompt = torch.randint(0, vocab, (4000,), generator=gen).tolist()
        root = engine.add_prompt(prompt[:-1])
        engine.extend([(root, prompt[-1:])])
        for _ in range(2):
            nodes, _ = engine.extend_tree(root, parents, list(range(len(parents))))
            engine.cache.prune(nodes[0])
        engine.cache.prune(root)
    else:
        raise SystemExit(f"unknown step {step!r}: expected b=20, greedy or t=256")


def main(argv: list[str]) -> None:
    json_path = argv[argv.index("--json") + 1] if "--json" in argv else None
    steps = [a for a in argv if a != "--json" and a != json_path] or ["b=20", "greedy", "t=256"]
    model, tok = load_random("random:llama-3-8b", "cuda")
    engine = TreeEngine(model, tok, num_pages=4096)
    gen, report = torch.Generator().manual_seed(0), {}
    for step in steps:
        run_step(engine, step, gen)
        graph = engine.graphs.last_graph
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(REPLAYS):
                graph.replay()
            torch.cuda.synchronize()
        events = sorted((e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA),
                        key=lambda e: e.time_range.start)
        kernels = defaultdict(lambda: [0.0, 0.0])  # name -> [kernel µs, own µs] per step
        covered = events[0].time_range.start if events else 0.0
        for e in events:
            start, end = e.time_range.start, e.time_range.end
            kernels[e.name][0] += (end - start) / REPLAYS
            kernels[e.name][1] += max(0.0, end - max(start, covered)) / REPLAYS
            covered = max(covered, end)
        by_kind = defaultdict(lambda: [0.0, 0.0])
        for name, (us, own) in kernels.items():
            by_kind[kind(name)][0] += us
            by_kind[kind(name)][1] += own
        span = sum(own for _, own in by_kind.values())
        report[step] = {"span_us": span, "by_kind": dict(by_kind),
                        "top": sorted(kernels.items(), key=lambda kv: -kv[1][0])[:12]}
        print(f"\n{step}: {span / 1e3:.2f} ms of kernels per replayed step (kernel ms, own ms, own %)")
        for k, (us, own) in sorted(by_kind.items(), key=lambda kv: -kv[1][1]):
            print(f"  {k:<18} {us / 1e3:7.3f} {own / 1e3:7.3f}  {100 * own / span:5.1f}%")
        for name, (us, own) in report[step]["top"]:
            print(f"    {us:8.1f} {own:8.1f} µs  {name[:100]}")
    if json_path:
        Path(json_path).write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main(args(__doc__))
