"""``deft bench attention --device cuda``: a 32-layer decode step of Llama-3-8B-shaped
attention (32 query heads, 8 KV heads, head_dim 128, bf16) on each benchmark tree.

Side by side in one process on the same inputs: DeFT-Flatten (plan-specialised launches,
and graph-safe ones whose captured step replays any later plan that fits), DeFT-Node and
DeFT-Node-Chunk plans and per-query decoding (split-KV, each query reads its whole path)
on the same Triton kernels; FlexAttention with the tree mask; PyTorch SDPA on materialised
per-query KV. Each layer has its own KV buffer so L2 cannot hold it across layers. Times
are ``triton.testing.do_bench`` medians (L2 flushed between repetitions), plain and as
CUDA-graph replays. The roofline floor is the larger of the unique KV bytes over the HBM
read bandwidth and the attention FLOPs over the bf16 matmul rate, both measured here.

With ``kv_dtype="fp8_e4m3"`` the two DeFT-Flatten rows are also run over FP8 copies of the
same K/V (per-head scales calibrated on each layer's K/V), next to the bf16 ones; their
floor counts one byte per K/V element, and ``max |diff|`` against the bf16 output is the
quantisation's.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Callable

import torch
import triton.testing

from deft.attention import TreeAttention
from deft.cache.pool import CALIBRATION_HEADROOM, FP8, quantize
from deft.ops import Capacity
from deft.layout import TreeLayout
from deft.ops.reference import visibility_mask
from deft.ops.triton.configs import CONFIGS

from .baselines import flex_tree_attention, sdpa_per_query
from .report import markdown_table, record, rows_as_dicts, write_record
from .timing import median_plan_seconds
from .trees import GPU_SUITE, available

__all__ = ["D", "DTYPE", "FP8", "H_KV", "H_Q", "LAYERS", "fp8_copy", "gpu_attention_report",
           "measure_ceilings", "planned_as_engine", "random_inputs", "time_us"]

H_Q, H_KV, D, LAYERS = 32, 8, 128, 32
DTYPE = torch.bfloat16


def measure_ceilings() -> tuple[float, float]:
    """(HBM read bytes/s from a large torch.sum, bf16 matmul FLOP/s from 8192^3), medians."""
    return _read_bandwidth(), _matmul_rate()


def _read_bandwidth() -> float:
    x = torch.randn(2**31 // 2, device="cuda", dtype=DTYPE)  # 2 GiB, freed on return
    t = triton.testing.do_bench(lambda: x.sum(), return_mode="median") * 1e-3
    return x.numel() * x.element_size() / t


def _matmul_rate() -> float:
    a = torch.randn(8192, 8192, device="cuda", dtype=DTYPE)
    b = torch.randn(8192, 8192, device="cuda", dtype=DTYPE)
    t = triton.testing.do_bench(lambda: a @ b, return_mode="median") * 1e-3
    return 2 * 8192**3 / t


def time_us(step: Callable[[], object], graph: bool) -> float:
    """Median µs of ``step``; with ``graph`` the step is captured once and replayed."""
    step()
    if not graph:
        return triton.testing.do_bench(step, return_mode="median") * 1e3
    g = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        step()
    torch.cuda.current_stream().wait_stream(s)
    with torch.cuda.graph(g):
        step()
    return triton.testing.do_bench(g.replay, return_mode="median") * 1e3


def random_inputs(tokens: int, queries: int, seed: int = 0
                  ) -> tuple[list[torch.Tensor], list[torch.Tensor], torch.Tensor]:
    """A step's random inputs on the GPU: each of the ``LAYERS`` layers' K and V ``[tokens,
    H_KV, D]``, and q ``[queries, H_Q, D]``, in ``DTYPE``, drawn in that order from ``seed``."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    ks = [torch.randn(tokens, H_KV, D, device="cuda", dtype=DTYPE, generator=gen)
          for _ in range(LAYERS)]
    vs = [torch.randn(tokens, H_KV, D, device="cuda", dtype=DTYPE, generator=gen)
          for _ in range(LAYERS)]
    return ks, vs, torch.randn(queries, H_Q, D, device="cuda", dtype=DTYPE, generator=gen)


def fp8_copy(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x [N, H_kv, D]`` in FP8 with per-head scales, as a calibrated pool stores it."""
    scale = x.float().abs().amax(dim=(0, 2)) * CALIBRATION_HEADROOM / torch.finfo(FP8).max
    return quantize(x, scale, FP8), scale


def planned_as_engine(layout: TreeLayout, capacity: Capacity | None,
                      kv_dtype: torch.dtype | None) -> TreeAttention:
    """A triton attention planned for ``layout`` as the engine plans it: unreserved, or
    reserved with ``capacity`` for the kernels' build its tree asks for (the engine's graph
    buckets keep one attention per build, ``TreeAttention.build``)."""
    attn = TreeAttention(H_Q, H_KV, D, backend="triton", device="cuda", capacity=capacity)
    attn.plan(layout, kv_dtype)
    if capacity is not None and attn.build != capacity.build:
        attn = TreeAttention(H_Q, H_KV, D, backend="triton", device="cuda",
                             capacity=capacity._replace(build=attn.build))
        attn.plan(layout, kv_dtype)
    return attn


def _bench_tree(name: str, layout: TreeLayout, bw: float, flops: float,
                progress: Callable[[str], None] | None, flex: bool = True,
                kv_dtype: str = "auto") -> dict:
    n = layout.num_tokens
    ks, vs, q = random_inputs(n, layout.num_queries)
    vis = visibility_mask(layout)
    kv_bytes = LAYERS * n * H_KV * D * 2 * DTYPE.itemsize
    flop = LAYERS * 4 * D * H_Q * int(vis.sum())
    floor_us = max(kv_bytes / bw, flop / flops) * 1e6
    row: dict = {"workload": name, "tokens": n, "queries": layout.num_queries,
                 "io_floor_us": kv_bytes / bw * 1e6, "flop_floor_us": flop / flops * 1e6,
                 "floor_us": floor_us, "impls": {}}
    fp8 = kv_dtype == "fp8_e4m3"
    if fp8:
        k8s, k_scales = zip(*map(fp8_copy, ks))
        v8s, v_scales = zip(*map(fp8_copy, vs))
        row["fp8_floor_us"] = max(kv_bytes / 2 / bw, flop / flops) * 1e6
    ref = None
    impls: dict[str, Callable[[int], torch.Tensor]] = {}
    # Graph-safe: fixed buffers for any tree of this many queries on this many tokens, so
    # the captured step stays valid across plans (its cost against the plan-specialised one).
    reserve = Capacity(layout.num_queries, max(n, 1)) if layout.num_queries else None
    for label, kind, capacity in (("DeFT-Flatten", "flatten", None),
                                  ("DeFT-Flatten graph-safe", "flatten", reserve),
                                  ("DeFT-Node", "node", None),
                                  ("DeFT-Node-Chunk", "node_chunk", None),
                                  ("per-query", "per_query", None)):
        if label.endswith("graph-safe") and capacity is None:
            continue
        if capacity is None:
            attn = TreeAttention(H_Q, H_KV, D, backend="triton", plan_kind=kind, device="cuda")
            plan = attn.plan(layout)
        else:  # reserved for the build the tree asks for, as the engine's graph buckets are
            attn = planned_as_engine(layout, capacity, None)
            plan = attn.current_plan
        # Planned with the GPU idle, as in decoding, where the next tree waits for the
        # sampled tokens (a host sync). The median of 101 plans after 10 warm-up ones: host
        # timings on shared machines swing within a run (tools/plan_time.py), and a median of
        # fewer plans does not settle them.
        torch.cuda.synchronize()
        row["impls"][label] = {"plan_ms": median_plan_seconds(attn, layout, 101, 10) * 1e3,
                               "tiles": plan.num_tiles, "partials": plan.num_partials}
        impls[label] = lambda l, a=attn: a.run(q, ks[l], vs[l])
        if fp8 and kind == "flatten":
            a8 = planned_as_engine(layout, capacity, FP8)
            row["impls"][label + " fp8"] = {"floor_us": row["fp8_floor_us"],
                                            "build": a8.build}
            impls[label + " fp8"] = lambda l, a=a8: a.run(q, k8s[l], v8s[l], k_scale=k_scales[l],
                                                          v_scale=v_scales[l])
    sm_scale = D**-0.5
    if flex:
        try:
            torch._dynamo.reset()  # a fresh compile per tree, not a fallback past the recompile limit
            impls["FlexAttention"] = flex_tree_attention(layout, q, ks, vs, sm_scale,
                                                         kernel_options={"BACKEND": "TRITON"})
            row["impls"]["FlexAttention"] = {}
        except Exception as exc:  # noqa: BLE001 - report, keep benchmarking the rest
            row["impls"]["FlexAttention"] = {"error": f"{type(exc).__name__}: {exc}"[:200]}
    try:
        sdpa = sdpa_per_query(layout, q, ks[0], vs[0], sm_scale)
        impls["SDPA per-query"] = lambda l: sdpa()
        row["impls"]["SDPA per-query"] = {"note": "one materialised layer reused for all layers"}
    except torch.cuda.OutOfMemoryError as exc:
        row["impls"]["SDPA per-query"] = {"error": str(exc)[:200]}
    for label, fn in impls.items():
        if progress:
            progress(f"{name}: {label}")
        out = fn(0).float()
        if ref is None:
            ref = out
        info = row["impls"][label]
        info["max_abs_diff"] = float((out - ref).abs().max())

        def step(fn=fn) -> None:
            for layer in range(LAYERS):
                fn(layer)

        info["us"] = time_us(step, graph=False)
        try:
            info["graph_us"] = time_us(step, graph=True)
        except Exception as exc:  # noqa: BLE001
            info["graph_us"] = math.nan
            info["graph_error"] = f"{type(exc).__name__}: {exc}"[:200]
    impls.clear()  # the peers' closures hold K/V copies too
    ks.clear()
    vs.clear()
    if fp8:
        del k8s, v8s, k_scales, v_scales
    torch.cuda.empty_cache()
    return row


def gpu_attention_report(names: list[str] | None = None, workloads: Path | None = None,
                         out: str | None = None, progress=None,  # noqa: ANN001
                         json_path: str | None = None, flex: bool = True,
                         kv_dtype: str = "auto") -> str:
    """Run the GPU suite (``flex``: with FlexAttention; ``kv_dtype="fp8_e4m3"``: DeFT-Flatten
    over FP8 K/V too); return a Markdown report (and write JSON details under ``out``, and
    the tables as a result record to ``json_path``)."""
    bw, flops = measure_ceilings()
    cfg = {f"{a} rows>={r}": c for (a, d, r), c in CONFIGS.items() if d == D}
    rows = []
    for name, layout in available(names or GPU_SUITE, workloads):
        rows.append(_bench_tree(name, layout, bw, flops, progress, flex, kv_dtype))
    header = (f"GPU: {torch.cuda.get_device_name()}; measured HBM read {bw / 1e12:.2f} TB/s, "
              f"bf16 matmul {flops / 1e12:.0f} TFLOP/s. Kernel config (head_dim {D}): {cfg}.")
    table = []
    for r in rows:
        imp = r["impls"]
        base = imp["per-query"].get("graph_us", math.nan)
        for label, info in imp.items():
            g = info.get("graph_us", math.nan)
            table.append([r["workload"], label, info.get("us", math.nan), g,
                          base / g if g == g else math.nan,
                          100 * info.get("floor_us", r["floor_us"]) / g if g == g else math.nan,
                          info.get("plan_ms", math.nan),
                          info.get("tiles", ""), info.get("max_abs_diff", math.nan)])
    headers = ["workload", "impl", "µs/step", "µs/step (graph)", "x vs per-query", "% roofline",
               "plan ms", "tiles", "max |diff|"]
    md = markdown_table(headers, table)
    floor_headers = ["workload", "tokens", "queries", "IO floor µs", "FLOP floor µs"]
    floor_rows = [[r["workload"], r["tokens"], r["queries"], r["io_floor_us"], r["flop_floor_us"]]
                  for r in rows]
    floors = markdown_table(floor_headers, floor_rows)
    if json_path:
        write_record(json_path, record(
            headers, table, "cuda", hbm_read_tb_s=round(bw / 1e12, 2),
            bf16_matmul_tflops=round(flops / 1e12), kernel_config=str(cfg),
            floors=rows_as_dicts(floor_headers, floor_rows)))
    if out:
        Path(out).mkdir(parents=True, exist_ok=True)
        Path(out, "gpu_bench.json").write_text(json.dumps(
            {"gpu": torch.cuda.get_device_name(), "hbm_bytes_per_s": bw, "bf16_flops": flops,
             "config": str(cfg), "rows": rows}, indent=1))
    return "\n\n".join([header, floors, md])
