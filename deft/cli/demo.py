"""``deft demo``: the engine's strategies on SmolLM2, then the attention core, on CPU."""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch

from ..attention import TreeAttention
from ..layout import TreeLayout
from ..ops.reference import reference_attention
from ..table import markdown_table
from . import common
from .common import CliError

__all__ = ["add_parser", "attention_demo", "engine_demo", "reasoning_trace", "run"]

BEAM_PROMPTS = ["Name three colours.", "What is the capital of France?"]
SAMPLE_PROMPT = "Write a short poem about the sea."
SPEC_PROMPT = ("Copy this list exactly, one item per line: apple, banana, cherry, grape, lemon, "
               "mango, orange, peach, pear, plum.")
DEMO_PAGES = 1024  # 16,384 token slots, more than any of the demo's trees holds at once


def add_parser(subparsers: Any) -> None:
    """Add the ``demo`` command to ``deft``'s subcommands."""
    demo = subparsers.add_parser("demo", parents=[common.model_flags(tensor_parallel=False)],
                                 help="run the main demo",
                                 description="Beam search, parallel sampling and speculative decoding "
                                 "with SmolLM2 on built-in prompts (texts, tokens/s, KV bytes DeFT reads "
                                 "against per-branch decoding), then the attention core on a few-shot "
                                 "tree (4,000-token prompt, 20 branches of 200 tokens) checked against "
                                 "dense attention.")
    demo.add_argument("--core", action="store_true", help="only the attention-core part (no model)")
    common.add_workloads_flag(demo)
    demo.set_defaults(func=run)


def run(args: argparse.Namespace) -> None:
    from ..cache import CacheFullError

    if args.tensor_parallel_size != 1:
        raise CliError("--tensor-parallel-size: the demo runs on one device; use deft generate, "
                       "sample, beam, speculate, replay or serve under torchrun")
    if not args.core:
        loaded = common.load(args)
        trace = reasoning_trace(args.workloads)
        budget = common.KVBudget.of(args)
        (pages,) = budget.pages([(loaded[0], DEMO_PAGES)])
        try:
            print(engine_demo(loaded, trace=trace, num_pages=pages, progress=common.progress,
                              kv_dtype=args.kv_dtype), flush=True)
        except CacheFullError as exc:
            raise budget.error(exc) from exc
        print()
    print(attention_demo())


def reasoning_trace(workloads: str | None) -> Path | None:
    """The recorded ``keywordToT`` trace the demo replays; ``None``, with a one-line note on
    stderr saying why, when the recorded workloads or the file are not there."""
    from ..recorded import workloads_dir

    try:
        trace = workloads_dir(workloads) / "deft" / "reasoning" / "keywordToT.json"
    except FileNotFoundError as exc:
        if workloads is not None:
            raise CliError(f"--workloads: {exc}") from exc
        print(f"note: the reasoning-trace replay is skipped: {exc}", file=sys.stderr)
        return None
    if not trace.is_file():
        print(f"note: the reasoning-trace replay is skipped: {trace} is not there", file=sys.stderr)
        return None
    return trace


def engine_demo(loaded: tuple[Any, Any], new_tokens: int = 24, trace: str | os.PathLike[str] | None = None,
                replay_iterations: int = 60, num_pages: int = DEMO_PAGES,
                progress: Callable[[str], None] | None = None, kv_dtype: str = "auto") -> str:
    """Beam search, parallel sampling, speculative decoding and, with a ``trace`` file, a
    reasoning trace replay of ``replay_iterations`` on built-in prompts; texts, tokens/s and
    K/V bytes read (decode steps), in a pool of ``num_pages`` pages of ``kv_dtype``.

    K/V bytes are those all layers read in the decode steps after each prompt's prefill:
    under DeFT's plan, and under per-branch decoding, where every query reads its whole path.
    """
    from ..engine import SamplingParams, TreeEngine, beam_search, replay_trace, sample

    model, tok = loaded
    say = progress or (lambda msg: None)
    engine = TreeEngine(model, tok, common.engine_config(num_pages, kv_dtype=kv_dtype,
                                                         backend="torch"))
    chat = [tok.apply_chat_template(p) for p in BEAM_PROMPTS]
    params_m = sum(p.numel() for p in model.parameters()) / 1e6
    lines = [f"DeFT engine demo: {model.config.num_layers}-layer SmolLM2 ({params_m:.0f}M parameters, "
             f"{model.dtype}) on {engine.device}, torch attention backend."]

    say("beam search")
    with _decode_io(engine) as io:
        beams = beam_search(engine, chat, 4, new_tokens, progress=io.on)
    lines += ["", f"Beam search, k=4, {new_tokens} new tokens, {len(chat)} prompts in one batch:"]
    for prompt, (best,) in zip(BEAM_PROMPTS, beams):
        lines.append(f"  {prompt!r} -> {best.text!r} (score {best.score:.3f})")
    lines.append(_speed(beams[0][0].stats["seconds"], engine, engine.stats["tokens"],
                        "tokens computed (prompts, then 4 beams each)"))

    say("parallel sampling")
    params = SamplingParams(temperature=0.8, top_p=0.95, seed=0, max_new_tokens=new_tokens)
    with _decode_io(engine) as io:
        (samples,) = sample(engine, [tok.apply_chat_template(SAMPLE_PROMPT)], 8, params, progress=io.on)
    lines += ["", f"Parallel sampling, n=8 branches sharing the prompt, T=0.8, top-p 0.95, "
              f"{new_tokens} new tokens, {SAMPLE_PROMPT!r}:"]
    lines += [f"  [{i + 1}] {r.text!r}" for i, r in enumerate(samples[:3])] + [f"  ... ({len(samples) - 3} more)"]
    lines.append(_speed(samples[0].stats["seconds"], engine, sum(len(r.token_ids) for r in samples),
                        "new tokens"))

    say("speculative decoding")
    lines += ["", *_speculative_lines(engine, tok, 2 * new_tokens)]

    if replay_iterations and trace is not None:
        say("reasoning trace replay")
        r = replay_trace(engine, trace, 0, max_iterations=replay_iterations)
        lines += ["", f"Reasoning-tree replay ({r.trace}, record 0, first {r.iterations} iterations: "
                  f"{r.prompt_tokens}-token prompt, up to {r.max_active} thoughts decoded at once, "
                  f"random tokens):",
                  f"  {r.decode_tokens} tokens in {r.decode_s:.2f} s ({r.tokens_per_s:.1f} tokens/s); "
                  f"K/V read: DeFT {r.kv_bytes_deft / 2**20:,.0f} MiB, per-branch decoding "
                  f"{r.kv_bytes_per_branch / 2**20:,.0f} MiB ({r.kv_ratio:.1f}x less)."]
    return "\n".join(lines)


def _speculative_lines(engine: Any, tok: Any, new_tokens: int) -> list[str]:
    """Speculative decoding (prompt lookup) against plain greedy decoding on SPEC_PROMPT."""
    from ..engine import SamplingParams, generate, speculative_generate

    ids = tok.apply_chat_template(SPEC_PROMPT)
    params = SamplingParams(max_new_tokens=new_tokens)
    (plain,) = generate(engine, [ids], params)
    (spec,) = speculative_generate(engine, [ids], params)
    st = spec.stats
    accepted = sum(st["accepted"]) / max(len(st["accepted"]), 1)
    return [
        f"Speculative decoding (prompt-lookup drafter, draft token trees verified in one forward), "
        f"greedy, {new_tokens} new tokens:",
        f"  {spec.text!r}",
        f"  {st['steps']} verification steps, {accepted:.2f} accepted draft tokens per step "
        f"({st['tokens_per_step']:.2f} new tokens per step); {st['tokens_per_s']:.1f} tokens/s "
        f"against {plain.stats['tokens_per_s']:.1f} for plain greedy decoding; same tokens: "
        f"{'yes' if spec.token_ids == plain.token_ids else 'no'}.",
    ]


class _decode_io:
    """Counts K/V bytes from the first progress callback on (the decode steps)."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine

    def __enter__(self) -> "_decode_io":
        self.engine.reset_stats()
        self.engine.count_io = False
        return self

    def on(self, _: int) -> None:
        self.engine.count_io = True

    def __exit__(self, *exc: object) -> None:
        self.engine.count_io = False


def _speed(seconds: float, engine: Any, count: int, what: str) -> str:
    st = engine.stats
    deft, per_branch = st["kv_bytes_deft"], st["kv_bytes_per_branch"]
    return (f"  {count} {what} in {seconds:.2f} s ({count / seconds:.1f}/s, {st['steps']} forwards); "
            f"K/V read in decode steps: DeFT {deft / 2**20:,.1f} MiB, per-branch decoding "
            f"{per_branch / 2**20:,.1f} MiB ({per_branch / max(deft, 1):.1f}x less).")


def attention_demo(prompt_len: int = 4000, branches: int = 20, branch_len: int = 200,
                   heads: tuple[int, int, int] = (32, 8, 128)) -> str:
    """Run DeFT on a few-shot tree, check it against dense attention, and count KV bytes."""
    h_q, h_kv, d = heads
    # A shared prompt with one query per branch (its newest token), tokens in shuffled slots.
    tree = TreeLayout.from_node_lengths([-1] + [0] * branches, [prompt_len] + [branch_len] * branches,
                                        list(range(1, branches + 1)))
    slots = np.random.default_rng(0).permutation(tree.num_tokens)
    layout = TreeLayout(tree.parents, tree.node_kv_indptr, slots, tree.query_nodes, tree.query_kv_lens)
    g = torch.Generator().manual_seed(0)
    q = torch.randn(layout.num_queries, h_q, d, generator=g)
    k = torch.randn(layout.num_tokens, h_kv, d, generator=g)
    v = torch.randn(layout.num_tokens, h_kv, d, generator=g)
    attn = TreeAttention(h_q, h_kv, d, backend="torch")
    plan = attn.plan(layout)
    t0 = time.perf_counter()
    o, lse = attn.run(q, k, v, return_lse=True)
    run_ms = (time.perf_counter() - t0) * 1e3
    ref_o, ref_lse = reference_attention(q, k, v, layout, attn.sm_scale)
    err_o = float((o.double() - ref_o).abs().max())
    err_lse = float((lse.double() - ref_lse).abs().max())
    per_query = attn.make_plan(layout, "per_query")
    rows = []
    for name, p in (("DeFT-Flatten", plan), ("per-query decoding", per_query)):
        io = p.io_bytes(h_q, h_kv, d, elem_bytes=2)
        rows.append([name, p.num_plan_tokens, io["kv"] / 2**20, io["total"] / 2**20])
    kv_ratio = rows[1][2] / rows[0][2]
    return "\n".join([
        f"DeFT attention core demo: a {prompt_len}-token prompt with {branches} branches of "
        f"{branch_len} tokens, one query per branch; {h_q} query heads, {h_kv} KV heads, "
        f"head_dim {d}.",
        f"Plan: {plan.num_tiles} tiles of {plan.block_kv} tokens, {plan.num_partials} partial "
        f"states, planned in {attn.plan_seconds * 1e3:.2f} ms; run on CPU (torch backend) in "
        f"{run_ms:.1f} ms.",
        f"Exactness against dense float64 attention: max |o - o_ref| = {err_o:.2e}, "
        f"max |lse - lse_ref| = {err_lse:.2e} (float32 inputs).",
        "",
        "KV read per layer in bf16 (one load per KV head):",
        markdown_table(["schedule", "KV tokens loaded", "KV MiB", "all IO MiB"], rows),
        f"DeFT reads {kv_ratio:.1f}x less KV than per-query decoding on this tree.",
    ])
