"""``deft bench e2e --device cuda``: whole decode steps of a Llama-3-8B-shaped model on a GPU.

The model has Llama-3-8B's shapes (32 layers, hidden 4096, 32/8 heads of 128, MLP 14336,
vocabulary 128256), or another shape of :data:`deft.model.synthetic.SHAPES` (``qwen3-8b``:
36 layers, MLP 12288, per-head q/k norms), and random bf16 weights, so nothing is downloaded. Every workload runs on
the same model in four engines: DeFT-Flatten with steps replayed as CUDA graphs (the
default; the host plans a step while the GPU runs the one before, see
:mod:`deft.engine.inflight`), the same waiting for each step's tokens ("no overlap"), the
same launched eagerly, and per-branch attention (``plan_kind="per_query"``:
each query reads its whole path, as Radix/Flash-Decoding do) replayed as graphs; and,
where it has the strategy, ``transformers`` ``generate`` on a model of the same shapes.
With ``unfused``, a fifth: graphs with the plain PyTorch ops instead of the fused kernels
(:mod:`deft.model.fused`).

ms/step is the wall time of the decode steps, divided by their number: what a user pays, host
work, planning and sampling included. The decode steps are those past the steps of a run that
stops after the first token; a timed run is clocked from the start of the first of them (its
prefill done on the GPU) to its end, so the prefill's run-to-run spread stays out of the
figure (the per-branch engine prefills with per-query attention too, each of a chunk's queries
reading its whole path). GPU ms/step is the run's last step alone, its graph replayed again:
the rest of a step is host time the GPU waits for. The floor of a step is the larger of
(weights read + the step's unique K/V bytes) over the HBM read bandwidth and the matmul FLOPs
(2 per weight per query token; attention FLOPs left out) over the bf16 matmul rate, both
measured in the same run; a workload's floor is its steps' mean.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable, Iterator

import torch
import triton

from .report import markdown_table, record, write_record
from .trees import apps_tree, medusa_parents

__all__ = ["GPU_WORKLOADS", "gpu_e2e_table", "run_workload"]


@dataclass(frozen=True)
class GpuWorkload:
    """``kind``: ``sample`` (``width`` branches), ``beam`` (``width`` beams), ``greedy``
    (``width`` independent prompts), ``verify`` (Medusa tree ``APPS_tree_size{width}``) or
    ``replay`` (reasoning trace ``trace``, its first ``new_tokens`` iterations; ``prompt`` and
    ``width`` are the record's prompt length and most thoughts decoding at once)."""

    name: str
    kind: str
    prompt: int
    width: int
    new_tokens: int
    trace: str = ""


POOL_PAGES = 4096  # 65,536 slots: the largest workload holds 32k + 16 x 128 tokens
_COUNTS = ("steps", "plan_tokens", "tokens")  # engine stats taken past the prefill's
_WARM_ROUNDS = 3  # warm-up rounds at most; the timed runs must then capture and compile nothing
REPLAY_ITERATIONS = 500  # of a trace's 564-3,708: the steps of all three take about a minute

GPU_WORKLOADS = [
    GpuWorkload("few-shot b=20", "sample", 4000, 20, 200),
    GpuWorkload("few-shot b=30", "sample", 4000, 30, 200),
    GpuWorkload("few-shot b=50", "sample", 4000, 50, 200),
    GpuWorkload("sampling n=16, 32k prompt", "sample", 32 * 1024, 16, 128),
    GpuWorkload("beam k=4", "beam", 2000, 4, 128),
    GpuWorkload("beam k=8", "beam", 2000, 8, 128),
    GpuWorkload("beam k=16", "beam", 2000, 16, 128),
    GpuWorkload("Medusa APPS-32 verify", "verify", 4000, 32, 20),
    GpuWorkload("Medusa APPS-64 verify", "verify", 4000, 64, 20),
    GpuWorkload("Medusa APPS-128 verify", "verify", 4000, 128, 20),
    GpuWorkload("Medusa APPS-256 verify", "verify", 4000, 256, 20),
    *(GpuWorkload(f"reasoning {t}", "replay", 0, 0, REPLAY_ITERATIONS, t)
      for t in ("sorting128ToT", "docmergeToT", "keywordToT")),
    GpuWorkload("greedy, 1 sequence", "greedy", 1000, 1, 128),
    GpuWorkload("greedy, 32 prompts", "greedy", 1000, 32, 128),
]


def run_workload(engine: Any, w: GpuWorkload, prompts: list[list[int]], new_tokens: int,
         parents: list[int] | None, trace: Path | None) -> Callable[[], int]:
    """One complete run of ``w`` on ``engine`` with ``new_tokens`` per branch (a replay:
    iterations); it returns the tokens decoded."""
    from deft.engine import SamplingParams, beam_search, generate, replay_trace, sample

    never = frozenset()
    if w.kind == "sample":
        params = SamplingParams(max_new_tokens=new_tokens, temperature=1.0, seed=0, stop_token_ids=never)
        return lambda: sum(len(r.token_ids) for r in sample(engine, prompts[0], w.width, params)[0])
    if w.kind == "beam":
        return lambda: len(beam_search(engine, prompts[0], w.width, new_tokens,
                                       stop_token_ids=never)[0][0].token_ids)
    if w.kind == "greedy":
        params = SamplingParams(max_new_tokens=new_tokens, stop_token_ids=never)
        return lambda: sum(len(r.token_ids) for r in generate(engine, prompts, params))
    if w.kind == "replay":
        return lambda: replay_trace(engine, trace, max_iterations=new_tokens,
                                    count_io=False).decode_tokens

    def verify() -> int:  # prefill, then ``new_tokens`` verifications of the draft tree
        root = engine.add_prompt(prompts[0][:-1])
        engine.extend([(root, prompts[0][-1:])])
        tokens = list(range(len(parents)))
        for _ in range(new_tokens):
            nodes, logits = engine.extend_tree(root, parents, tokens)
            logits.argmax(-1).tolist()  # the acceptance decision waits for the logits
            engine.cache.prune(nodes[0])
        engine.cache.prune(root)
        return new_tokens
    return verify


def _timed(run: Callable[[], int]) -> tuple[float, int]:
    """Wall seconds of ``run`` (the GPU done), and what it returned."""
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    out = run()
    torch.cuda.synchronize()
    return time.perf_counter() - t0, out


@contextlib.contextmanager
def _compiles() -> Iterator[list[str]]:
    """The Triton kernels compiled (or loaded from Triton's cache) in the block, as their
    specialisations (name, then each argument's type and what it was specialised on)."""
    seen: list[str] = []
    before = triton.knobs.runtime.jit_post_compile_hook

    def hook(*, repr: str, **kw: Any) -> Any:
        seen.append(repr)
        return before(repr=repr, **kw) if before else None

    triton.knobs.runtime.jit_post_compile_hook = hook
    try:
        yield seen
    finally:
        triton.knobs.runtime.jit_post_compile_hook = before


@contextlib.contextmanager
def _decode_start(engine: Any, first: int) -> Iterator[list[Any]]:
    """In the block, the wall time at which ``engine`` starts its step number ``first``
    (0-based, from the stats' last reset), the GPU done with the steps before it, and its
    stats as the step before it left them (the engine counts a step's layout before its
    run): the list it yields holds both once that step starts."""
    runner, start = engine.runner, []
    run, own = runner.run, vars(runner).get("run")
    before = dict(engine.stats)

    def clocked(step: Any) -> Any:
        nonlocal before
        if not start and engine.stats["steps"] == first:
            torch.cuda.synchronize()
            start.extend((time.perf_counter(), before))
        out = run(step)
        if not start:
            before = dict(engine.stats)
        return out

    runner.run = clocked
    try:
        yield start
    finally:
        if own is None:
            del runner.run
        else:
            runner.run = own


def _measure(engine: Any, w: GpuWorkload, prompts: list[list[int]],
             parents: list[int] | None, trace: Path | None,
             say: Callable[[str], None] = lambda msg: None) -> dict[str, float]:
    """Warm-up rounds of a full run and a prefill-only run, then a timed full run: ms per
    decode step and what the decode steps held."""
    full = run_workload(engine, w, prompts, w.new_tokens, parents, trace)
    first = run_workload(engine, w, prompts, 1, parents, trace)
    # Warm-up: compiles and captures every graph the timed run replays. A run grows the
    # graph buckets' capacities, and a step whose tree did not fit a bucket's attention of
    # another build (``Capacity.build``) before may fit it then: repeat until a round
    # captures and compiles nothing. A kernel compiled in a timed run would count its
    # seconds as steps'.
    def captures() -> int:
        return engine.graphs.captures if engine.graphs is not None else 0

    def prefill() -> dict[str, float]:
        """The prefill-only run's counts: the decode steps are the ones after its steps."""
        engine.reset_stats()
        first()
        return {k: engine.stats[k] for k in _COUNTS}

    with _compiles() as compiled:
        for round_ in range(_WARM_ROUNDS):
            before = captures(), len(compiled)
            full()
            base = prefill()
            if round_ and len(compiled) > before[1]:
                say(f"{w.name}: warm-up round {round_ + 1} compiled {compiled[before[1]:]}")
            if (captures(), len(compiled)) == before:
                break
        for _ in range(2):
            engine.reset_stats()
            before = captures(), len(compiled)
            with _decode_start(engine, base["steps"]) as start:
                t_full, new = _timed(full)
                end = time.perf_counter()
            if (captures(), len(compiled)) == before and start:
                break
            say(f"{w.name}: the timed run of {engine.stats['steps']} steps (decode from step "
                f"{base['steps']}) captured {captures() - before[0]} graphs and compiled "
                f"{compiled[before[1]:]}; timing again")
            base = prefill()  # the new graphs may plan the prefill's steps differently
        else:
            raise RuntimeError(f"{w.name}: timed runs kept capturing graphs, compiling kernels "
                               "or ending before their first decode step")
    st = engine.stats
    steps, plan_tokens, queries = (st[k] - base[k] for k in _COUNTS)
    at_start = start[1]  # the stats before the first decode step
    # The GPU time of the run's last step alone: its graph replayed again (same inputs).
    last = engine.graphs.last_graph if engine.graphs is not None else None
    gpu_ms = None if last is None else triton.testing.do_bench(last.replay, return_mode="median")
    return {"ms_step": 1e3 * (end - start[0]) / steps, "steps": steps, "wall": t_full, "new": new,
            "gpu_ms": gpu_ms,
            "plan_tokens": plan_tokens / steps, "queries": queries / steps,
            "plan_ms": 1e3 * (st["plan_s"] - at_start["plan_s"]) / steps,
            "host": 1 - (st["graph_steps"] - at_start["graph_steps"]) / steps}


def _replayed(w: GpuWorkload, workloads: Path) -> tuple[GpuWorkload, Path]:
    """``w`` with its trace's prompt length and widest iteration, and the trace's path."""
    from deft.engine import load_trace

    path = workloads / "deft" / "reasoning" / f"{w.trace}.json"
    data = load_trace(path)
    width = max(sum(v["start"] <= it <= v["end"] for n, v in data.items() if n)
                for it in range(1, w.new_tokens + 1))
    return replace(w, prompt=data[0]["value"], width=width), path


def _hf_seconds(hf: Any, w: GpuWorkload, prompts: list[list[int]]) -> float | None:
    """Wall time of ``transformers`` ``generate`` for ``w`` (``None``: it has no such strategy,
    or it ran out of GPU memory)."""
    if w.kind not in ("sample", "beam"):
        return None
    ids = torch.tensor(prompts[:1], device="cuda")
    kw = dict(max_new_tokens=w.new_tokens, min_new_tokens=w.new_tokens, eos_token_id=None,
              pad_token_id=0, attention_mask=torch.ones_like(ids))
    if w.kind == "sample":
        kw.update(do_sample=True, num_return_sequences=w.width, top_k=0)
    else:
        kw.update(do_sample=False, num_beams=w.width)
    try:
        with torch.no_grad():
            hf.generate(ids, **{**kw, "max_new_tokens": 2, "min_new_tokens": 2})  # warm-up
            return _timed(lambda: hf.generate(ids, **kw))[0]
    except torch.cuda.OutOfMemoryError:  # e.g. 16 copies of a 32k prompt next to our engines
        pass
    # Out of the handler: its traceback's frames hold the failed run's tensors until it ends.
    torch.cuda.empty_cache()
    return None


def _hf_model(config: Any) -> Any:
    import transformers

    kind = "Qwen3" if config.qk_norm else "Llama"
    cfg = getattr(transformers, f"{kind}Config")(
        vocab_size=config.vocab_size, hidden_size=config.hidden_size,
        intermediate_size=config.intermediate_size, num_hidden_layers=config.num_layers,
        num_attention_heads=config.num_heads, num_key_value_heads=config.num_kv_heads,
        head_dim=config.head_dim, max_position_embeddings=config.max_position_embeddings,
        rope_theta=config.rope_theta)
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device("cuda"):
            return getattr(transformers, f"{kind}ForCausalLM")(cfg).eval()
    finally:
        torch.set_default_dtype(default)


def model_config(shape: str, layers: int | None, chosen: list[GpuWorkload]) -> Any:
    """The random model's config of ``shape`` (``layers`` of it, ``None``: all), its RoPE table
    long enough for the ``chosen`` workloads' prompts and new tokens (nothing else changes)."""
    from deft.model.synthetic import RandomSpec

    config = RandomSpec(shape, layers).config
    context = max(w.prompt + w.new_tokens for w in chosen)
    if context > config.max_position_embeddings:
        config = replace(config, max_position_embeddings=context)
    return config


def workload_inputs(w: GpuWorkload, workloads: Path | None, vocab: int, gen: torch.Generator
                    ) -> tuple[GpuWorkload, list[list[int]], list[int] | None, Path | None]:
    """``w`` as it runs (a replayed trace's prompt and widest iteration), its random prompts
    and its draft tree's parents or trace, from the recorded workloads (``workloads``, else
    the default of :func:`deft.recorded.workloads_dir`; ``FileNotFoundError`` where ``w``
    needs them and they are missing)."""
    from deft.recorded import workloads_dir

    parents = trace = None
    if w.kind == "verify":
        parents = medusa_parents(apps_tree(w.width, workloads_dir(workloads)))
    elif w.kind == "replay":
        w, trace = _replayed(w, workloads_dir(workloads))
    count = w.width if w.kind == "greedy" else 1
    prompts = torch.randint(0, vocab, (count, w.prompt), generator=gen).tolist()
    return w, prompts, parents, trace


def gpu_e2e_table(names: list[str] | None = None, workloads: Path | None = None,
                  layers: int | None = None, with_transformers: bool = True, unfused: bool = False,
                  progress: Callable[[str], None] | None = None,
                  json_path: str | None = None, kv_dtype: str = "auto",
                  shape: str = "llama-3-8b") -> str:
    """Markdown table of the GPU workloads (see the module docstring); also a result record.
    ``kv_dtype="fp8_e4m3"``: also the graph engine with an FP8 K/V cache; ``shape``: a key
    of :data:`deft.model.synthetic.SHAPES`, ``layers`` of it (``None``: all)."""
    from deft.engine import TreeEngine
    from deft.model.synthetic import byte_tokenizer, random_model

    from .attention_gpu import measure_ceilings

    say = progress or (lambda msg: None)
    chosen = [w for w in GPU_WORKLOADS if not names or w.name in names]
    if names and len(chosen) != len(set(names)):
        known = ", ".join(w.name for w in GPU_WORKLOADS)
        raise ValueError(f"workload: unknown name in {names}; known: {known}")
    config = model_config(shape, layers, chosen)
    layers = config.num_layers
    bw, rate = measure_ceilings()
    model, tok = random_model(config, "cuda"), byte_tokenizer(config.vocab_size)
    weight_bytes = sum(p.numel() * p.element_size() for n, p in model.named_parameters()
                       if not n.startswith("embed.") or model.lm_head is None)
    matmul_weights = sum(p.numel() for n, p in model.named_parameters() if p.dim() == 2
                         and not n.startswith("embed."))
    kv_token_bytes = 2 * config.num_layers * config.num_kv_heads * config.head_dim * 2
    pages = POOL_PAGES
    engines = {"graph": TreeEngine(model, tok, num_pages=pages),
               "graph, no overlap": TreeEngine(model, tok, num_pages=pages, overlap=False),
               "eager": TreeEngine(model, tok, num_pages=pages, cuda_graphs=False),
               "per-branch": TreeEngine(model, tok, num_pages=pages, plan_kind="per_query")}
    if unfused:
        engines["graph, unfused"] = TreeEngine(model, tok, num_pages=pages)
    fp8 = kv_dtype == "fp8_e4m3"
    if fp8:
        engines["graph, fp8"] = TreeEngine(model, tok, num_pages=pages, kv=kv_dtype)
    hf = _hf_model(config) if with_transformers else None
    gen = torch.Generator().manual_seed(0)
    rows = []
    for w in chosen:
        try:
            w, prompts, parents, trace = workload_inputs(w, workloads, config.vocab_size, gen)
        except FileNotFoundError as exc:
            say(f"{w.name}: skipped ({exc})")
            continue
        got = {}
        for mode, engine in engines.items():
            say(f"{w.name}: {mode}")
            model.fused_ops = False if mode == "graph, unfused" else None  # graphs keep theirs
            got[mode] = _measure(engine, w, prompts, parents, trace, say)
        model.fused_ops = None
        g = got["graph"]
        floor_ms = 1e3 * max((weight_bytes + g["plan_tokens"] * kv_token_bytes) / bw,
                             2 * matmul_weights * g["queries"] / rate)
        hf_s = None
        if hf is not None:
            say(f"{w.name}: transformers")
            hf_s = _hf_seconds(hf, w, prompts)
        rows.append([w.name, w.prompt, round(g["queries"], 1), g["ms_step"], g["gpu_ms"],
                     got["graph, no overlap"]["ms_step"],
                     *([got["graph, unfused"]["ms_step"]] if unfused else []),
                     *([got["graph, fp8"]["ms_step"]] if fp8 else []), got["eager"]["ms_step"],
                     got["per-branch"]["ms_step"], floor_ms, 100 * floor_ms / g["ms_step"],
                     got["per-branch"]["ms_step"] / g["ms_step"],
                     g["new"] / g["wall"], None if hf_s is None else hf_s / g["wall"],
                     g["plan_ms"], 100 * g["host"]])
        say(f"{w.name}: {rows[-1]}")
    headers = ["workload", "prompt", "queries/step", "graph ms/step", "GPU ms/step",
               "no-overlap ms/step",
               *(["unfused graph ms/step"] if unfused else []),
               *(["fp8 K/V graph ms/step"] if fp8 else []), "eager ms/step",
               "per-branch ms/step", "floor ms/step", "% of floor", "speed-up over per-branch",
               "tokens/s", "speed-up over transformers", "plan ms/step", "eager steps %"]
    name = torch.cuda.get_device_name()
    if json_path:
        write_record(json_path, record(headers, rows, "cuda", gpu=name, layers=layers,
                                       hbm_bytes_per_s=bw, matmul_flops=rate,
                                       model=f"{shape} shapes, random bf16 weights"))
    return (f"{shape} shapes ({layers} layers, random bf16 weights) on {name}; HBM "
            f"{bw / 1e12:.2f} TB/s, bf16 matmul {rate / 1e12:.0f} TFLOP/s measured in this run.\n\n"
            + markdown_table(headers, rows))
