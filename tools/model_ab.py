"""One of the model's launch switches off and on, side by side on graph engines (GPU).

``--switch chain``: the model's kernels chained by programmatic dependent launch on sm_90+
(:func:`deft.model.fused.chained`, :func:`~deft.model.fused.set_chained`) or not.
``--switch wide``: qkv through the few-row kernel and gate/up fused with SiLU·mul
(:mod:`deft.model.skinny`, at the row counts it takes them) or both on cuBLAS.
``--switch rows``: the few-row kernels up to ``skinny.MAX_ROWS`` rows or only up to 32.
This builds one random Llama-3-8B-shaped model and two graph engines on it, one captured
with the switch off and one with it on (a step's graph keeps what its capture launched),
and measures e2e workloads on each in turns (the order reversed every other round), as
``deft bench e2e`` measures its graph column: ms per decode step, host work included, and
the GPU time of the run's last step replayed alone.

Usage: ``python tools/model_ab.py [--switch chain|wide|rows] [--rounds N] [--pages N]
[--json PATH] [WORKLOAD ...]`` (names of ``benchmarks.e2e_gpu.GPU_WORKLOADS``; the recorded
ones need the recorded workloads, ``$DEFT_WORKLOADS``, else ``../shared/workloads``).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

DEFAULT = ["greedy, 1 sequence", "few-shot b=20", "few-shot b=50", "beam k=16",
           "reasoning sorting128ToT", "greedy, 32 prompts"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("workloads", nargs="*", default=DEFAULT, help="e2e workload names")
    ap.add_argument("--switch", choices=("chain", "wide", "rows"), default="chain",
                    help="what differs between the two engines (default: chain)")
    ap.add_argument("--rounds", type=int, default=3, help="measurements of each engine")
    ap.add_argument("--pages", type=int, help="K/V pool pages of each engine "
                    "(default: deft bench e2e's)")
    ap.add_argument("--json", help="also write the figures here")
    a = ap.parse_args()

    import torch

    from benchmarks import e2e_gpu
    from deft.engine import TreeEngine
    from deft.model import fused, skinny
    from deft.model.synthetic import byte_tokenizer, random_model

    known = {w.name: w for w in e2e_gpu.GPU_WORKLOADS}
    unknown = [n for n in a.workloads if n not in known]
    if unknown:
        raise SystemExit(f"unknown workload(s) {unknown}; known: {', '.join(known)}")
    config = e2e_gpu.model_config("llama-3-8b", None, [known[n] for n in a.workloads])
    model, tok = random_model(config, "cuda"), byte_tokenizer(config.vocab_size)
    wide, rows = (skinny._WIDE_ROWS, skinny._GATED_ROWS), skinny.MAX_ROWS

    def switch(on: bool) -> None:
        if a.switch == "chain":
            fused.set_chained(on)
        elif a.switch == "wide":
            skinny._WIDE_ROWS, skinny._GATED_ROWS = wide if on else (0, skinny.MAX_ROWS + 1)
        else:
            skinny.MAX_ROWS = rows if on else 32

    modes = {"off": False, "on": True}
    pages = a.pages or e2e_gpu.POOL_PAGES
    engines = {m: TreeEngine(model, tok, num_pages=pages) for m in modes}
    gen = torch.Generator().manual_seed(0)
    got: dict[str, dict[str, list[dict[str, float]]]] = {}
    for name in a.workloads:
        w, prompts, parents, trace = e2e_gpu.workload_inputs(known[name], None,
                                                             config.vocab_size, gen)
        got[name] = {m: [] for m in modes}
        for r in range(a.rounds):
            for m in (modes if r % 2 == 0 else list(modes)[::-1]):
                switch(modes[m])
                res = e2e_gpu._measure(engines[m], w, prompts, parents, trace, print)
                got[name][m].append({"ms_step": res["ms_step"], "gpu_ms": res["gpu_ms"]})
                print(f"{name}, {a.switch} {m}, round {r + 1}: {res['ms_step']:.3f} ms/step, "
                      f"GPU {res['gpu_ms']:.3f} ms", flush=True)
    print(f"\n{torch.cuda.get_device_name()}; each cell: the rounds' figures\n")
    print(f"| workload | {a.switch} | ms/step | GPU ms/step |\n| --- | --- | --- | --- |")
    for name, by in got.items():
        for m, runs in by.items():
            cells = ["/".join(f"{x[k]:.3f}" for x in runs) for k in ("ms_step", "gpu_ms")]
            print(f"| {name} | {m} | {cells[0]} | {cells[1]} |")
    if a.json:
        Path(a.json).write_text(json.dumps({"gpu": torch.cuda.get_device_name(),
                                            "switch": a.switch, "pages": pages,
                                            "workloads": got}, indent=1) + "\n")


if __name__ == "__main__":
    main()
