"""The ``deft`` command: generation (generate, sample, beam), the demo and benchmarks."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any, Callable, Sequence

__all__ = ["main", "build_parser"]


class CliError(Exception):
    """A user error: printed as one line, exit code 2."""


class _Parser(argparse.ArgumentParser):
    """Argument errors as one line on stderr (exit code 2), pointing to ``--help``."""

    def error(self, message: str) -> None:  # type: ignore[override]
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def _workloads(path: str | None) -> Path | None:
    from .recorded import workloads_dir

    try:
        return workloads_dir(path)
    except FileNotFoundError as exc:
        if path is not None:
            raise CliError(str(exc)) from exc
        print(f"note: {exc}; recorded workloads are skipped", file=sys.stderr)
        return None


def cmd_demo(args: argparse.Namespace) -> None:
    from .demo import attention_demo, engine_demo

    if not args.core:
        print(engine_demo(_load(args), progress=_progress), flush=True)
        print()
    print(attention_demo())


def cmd_bench_plan(args: argparse.Namespace) -> None:
    from .bench.plan_bench import plan_table

    print(plan_table(args.workload or None, _workloads(args.workloads), args.block_kv, args.reps))


def cmd_bench_attention(args: argparse.Namespace) -> None:
    import torch

    if args.device == "cuda":
        if not torch.cuda.is_available():
            raise CliError("--device cuda: no CUDA device is available")
        from .bench.gpu_bench import gpu_attention_report

        print(gpu_attention_report(args.workload or None, _workloads(args.workloads),
                                   out=args.out, progress=_progress))
        return
    from .bench.attention_bench import cpu_attention_table

    print(cpu_attention_table(args.workload or None, _workloads(args.workloads),
                              flex=not args.no_flex, reps=args.reps, progress=_progress))


def cmd_replay(args: argparse.Namespace) -> None:
    from dataclasses import asdict

    from tqdm import tqdm

    from .engine import TreeEngine, replay_trace
    from .engine.replay import load_trace

    path = Path(args.trace)
    if not path.suffix:  # a task name
        base = _workloads(args.workloads)
        if base is None:
            raise CliError(f"TRACE {args.trace!r}: a task name needs the recorded workloads; "
                           "pass a file path or --workloads DIR")
        path = base / "deft" / "reasoning" / f"{args.trace}.json"
    if args.iterations is not None:
        _in_range(args.iterations, "--iterations", 1, 1 << 30)
    try:
        data = load_trace(path, args.record)
    except (FileNotFoundError, ValueError) as exc:
        raise CliError(f"TRACE: {exc}") from exc
    model, tok = _load(args)
    tokens = sum(v["value"] for v in data.values())
    engine = TreeEngine(model, tok, num_pages=-(-tokens // 16) + 2 * len(data) + 8, device=args.device)
    last = max(v["end"] for v in data.values())
    total = min(last, args.iterations or last)
    with tqdm(total=total, unit="it", desc="replay", leave=False, disable=None) as bar:
        r = replay_trace(engine, path, args.record, args.iterations, args.tokens, progress=bar.update)
    if args.json:
        print(json.dumps({**asdict(r), "tokens_per_s": r.tokens_per_s, "kv_ratio": r.kv_ratio}))
        return
    print(f"{r.trace} record {r.record}: {r.iterations} iterations, {r.prompt_tokens}-token prompt, "
          f"{r.thoughts} thoughts (up to {r.max_active} at once), peak {r.peak_pages} pages of 16")
    print(f"prefill {r.prefill_s:.2f} s; decode {r.decode_tokens} tokens in {r.decode_s:.2f} s "
          f"({r.tokens_per_s:.1f} tokens/s)")
    print(f"K/V read in decode: DeFT {r.kv_bytes_deft / 2**20:,.0f} MiB, per-branch decoding "
          f"{r.kv_bytes_per_branch / 2**20:,.0f} MiB ({r.kv_ratio:.1f}x less)")


def cmd_bench_e2e(args: argparse.Namespace) -> None:
    import torch

    from .bench.e2e_bench import WORKLOADS, e2e_table

    if args.device == "cuda" and not torch.cuda.is_available():
        raise CliError("--device cuda: no CUDA device is available")
    known = [w.name for w in WORKLOADS]
    for name in args.workload or []:
        if name not in known:
            raise CliError(f"--workload: expected one of {', '.join(map(repr, known))}, got {name!r}")
    _in_range(args.reps, "--reps", 1, 100)
    if args.threads is not None:
        torch.set_num_threads(_in_range(args.threads, "--threads", 1, 1024))
    print(e2e_table(args.device, args.workload, args.reps, progress=_progress), flush=True)
    if args.speculative:
        from .bench.spec_bench import spec_table

        print()
        print(spec_table(device=args.device, reps=args.reps, progress=_progress))


def _progress(msg: str) -> None:
    print(f"  ... {msg}", file=sys.stderr, flush=True)


# ------------------------------------------------------------------ generation

MAX_SAMPLES, MAX_BEAMS = 256, 64


def _load(args: argparse.Namespace) -> tuple[Any, Any]:
    """The model and tokenizer of ``--model`` on ``--device``; user errors as :class:`CliError`."""
    import torch

    from .model import load_model

    if args.device == "cuda" and not torch.cuda.is_available():
        raise CliError("--device cuda: no CUDA device is available")
    try:
        return load_model(args.model, device=args.device)
    except (FileNotFoundError, ValueError) as exc:
        raise CliError(f"--model: {exc}") from exc


def _params(args: argparse.Namespace, default_temperature: float) -> Any:
    """``SamplingParams`` from the flags; a bad value names its flag."""
    from .engine import SamplingParams

    temperature = default_temperature if args.temperature is None else args.temperature
    if temperature == 0:
        for flag, value, off in (("--top-k", args.top_k, 0), ("--top-p", args.top_p, 1.0),
                                 ("--seed", args.seed, None)):
            if value != off:
                raise CliError(f"{flag}: has no effect with --temperature 0 (greedy); "
                               "set --temperature > 0 to sample")
    try:
        return SamplingParams(temperature=temperature, top_k=args.top_k, top_p=args.top_p,
                              seed=args.seed, max_new_tokens=args.max_new_tokens)
    except ValueError as exc:
        field, _, why = str(exc).partition(": ")
        raise CliError(f"--{field.replace('_', '-')}: {why}") from exc


def _in_range(value: int, flag: str, low: int, high: int) -> int:
    if not low <= value <= high:
        raise CliError(f"{flag}: expected an integer in [{low}, {high}], got {value}")
    return value


def _run_engine(args: argparse.Namespace, branches: int,
                run: Callable[[Any, list[list[int]], Callable[[int], None]], list]) -> list:
    """Load the model, encode the prompts, size the cache and call ``run(engine, prompts, progress)``."""
    from tqdm import tqdm

    from .cache import CacheFullError
    from .engine import TreeEngine

    _in_range(args.max_new_tokens, "--max-new-tokens", 1, 1 << 20)
    model, tok = _load(args)
    try:
        prompts = [tok.apply_chat_template(p) if args.chat else tok.encode(p) for p in args.prompt]
    except ValueError as exc:
        raise CliError(f"--chat: {exc}") from exc
    for i, p in enumerate(prompts):
        if not p:
            raise CliError(f"PROMPT {i + 1}: encodes to no tokens")
        if len(p) > model.config.max_position_embeddings:
            raise CliError(f"PROMPT {i + 1}: {len(p)} tokens, longer than the model's context of "
                           f"{model.config.max_position_embeddings}")
    tokens = sum(len(p) + branches * (args.max_new_tokens + 16) for p in prompts)
    engine = TreeEngine(model, tok, num_pages=2 * -(-tokens // 16) + 8, device=args.device)
    total = len(prompts) * branches * args.max_new_tokens
    with tqdm(total=total, unit="tok", desc=args.command, leave=False, disable=None) as bar:
        try:
            return run(engine, prompts, bar.update)
        except (ValueError, CacheFullError) as exc:
            raise CliError(str(exc)) from exc


def _report(args: argparse.Namespace, groups: list[list[Any]], label: str) -> None:
    """Results as JSON (one list) or as text, and a speed line on stderr."""
    flat = [(i, j, r) for i, group in enumerate(groups) for j, r in enumerate(group)]
    if args.json:
        print(json.dumps([{"prompt": i, label: j, "text": r.text, "token_ids": r.token_ids,
                           "score": r.score, "finish_reason": r.stats["finish_reason"]}
                          for i, j, r in flat]))
    else:
        for i, j, r in flat:
            head = f"[prompt {i + 1}" + (f", {label} {j + 1}" if len(groups[i]) > 1 else "")
            print(f"{head}, score {r.score:.3f}]\n{r.text}\n")
    st = flat[0][2].stats
    new = sum(len(r.token_ids) for _, _, r in flat)
    print(f"[{args.command}] {new} new tokens in {st['seconds']:.2f} s "
          f"({new / st['seconds']:.1f} tokens/s, {st['steps']} forwards)", file=sys.stderr)


def cmd_generate(args: argparse.Namespace) -> None:
    from .engine.strategies import generate

    params = _params(args, 0.0)
    results = _run_engine(args, 1, lambda eng, prompts, bar: generate(eng, prompts, params, progress=bar))
    _report(args, [[r] for r in results], "sample")


def cmd_sample(args: argparse.Namespace) -> None:
    from .engine.strategies import sample

    n = _in_range(args.n, "-n", 1, MAX_SAMPLES)
    params = _params(args, 1.0)
    if params.greedy:
        raise CliError("--temperature 0: the samples would all be the greedy sequence; "
                       "use a temperature > 0, or deft generate")
    results = _run_engine(args, n, lambda eng, prompts, bar: sample(eng, prompts, n, params, progress=bar))
    _report(args, results, "sample")


def cmd_beam(args: argparse.Namespace) -> None:
    from .engine.beam import beam_search

    k = _in_range(args.k, "-k", 1, MAX_BEAMS)
    ret = _in_range(args.num_return_sequences, "--num-return-sequences", 1, k)
    stop = {"true": True, "false": False, "never": "never"}[args.early_stopping]
    results = _run_engine(args, k, lambda eng, prompts, bar: beam_search(
        eng, prompts, k, args.max_new_tokens, args.length_penalty, stop, ret, progress=bar))
    _report(args, results, "beam")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="deft",
        description="DeFT: exact, IO-aware attention for tree-structured LLM decoding.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    model = argparse.ArgumentParser(add_help=False)
    model.add_argument("--model", metavar="PATH",
                       help="GGUF file or Hugging Face directory (default: SmolLM2-135M-Instruct GGUF)")
    model.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="default cpu")
    gen = argparse.ArgumentParser(add_help=False, parents=[model])
    gen.add_argument("prompt", nargs="+", metavar="PROMPT", help="prompt text (several: one batch)")
    gen.add_argument("--max-new-tokens", type=int, default=64, metavar="N",
                     help="tokens to generate per sequence (default 64)")
    gen.add_argument("--chat", action="store_true", help="wrap each prompt in the model's chat template")
    gen.add_argument("--json", action="store_true",
                     help="print one JSON list: per result prompt index, text, token_ids "
                     "(generated only, stop token included), score, finish_reason")
    sampling = argparse.ArgumentParser(add_help=False)
    sampling.add_argument("--temperature", type=float, metavar="T",
                          help="0 = greedy (default: 0 for generate, 1 for sample)")
    sampling.add_argument("--top-k", type=int, default=0, metavar="K", help="keep the K most likely tokens (0 = off)")
    sampling.add_argument("--top-p", type=float, default=1.0, metavar="P",
                          help="keep the smallest set of tokens with mass >= P (1 = off)")
    sampling.add_argument("--seed", type=int, help="random seed (reproducible sampling)")

    g = sub.add_parser("generate", parents=[gen, sampling], help="generate a continuation per prompt",
                       description="Generate one continuation per PROMPT; all prompts advance in one "
                       "forward per step. Greedy unless --temperature > 0.")
    g.set_defaults(func=cmd_generate)
    s_ = sub.add_parser("sample", parents=[gen, sampling], help="N samples per prompt sharing its KV",
                        description="Draw N samples per PROMPT: the branches fork from the prompt "
                        "and share its KV cache; every branch of every prompt advances in one "
                        "forward per step.")
    s_.add_argument("-n", type=int, required=True, help=f"samples per prompt (1..{MAX_SAMPLES})")
    s_.set_defaults(func=cmd_sample)
    b = sub.add_parser("beam", parents=[gen], help="beam search (same results as transformers)",
                       description="Beam search with K beams per PROMPT, as transformers' "
                       "generate(num_beams=K): beams are leaves of one tree, pruned beams "
                       "release their KV at once.")
    b.add_argument("-k", type=int, required=True, help=f"beams per prompt (1..{MAX_BEAMS})")
    b.add_argument("--length-penalty", type=float, default=1.0,
                   help="score = sum logprob / length ** this (default 1.0)")
    b.add_argument("--early-stopping", choices=["false", "true", "never"], default="false",
                   help="transformers' early_stopping (default false)")
    b.add_argument("--num-return-sequences", type=int, default=1, metavar="R",
                   help="hypotheses to print per prompt (1..K, default 1)")
    b.set_defaults(func=cmd_beam)
    try:
        from .cli_speculate import add_parser as add_speculate
    except ImportError:
        add_speculate = None
    if add_speculate is not None:
        add_speculate(sub)

    rp = sub.add_parser("replay", parents=[model], help="replay a recorded reasoning tree",
                        description="Drive the engine through a recorded Graph-of-Thoughts tree: "
                        "each iteration every active thought decodes one token in one forward, "
                        "thoughts branch and end as recorded. Reports tokens/s and the K/V bytes "
                        "DeFT reads against per-branch decoding.")
    rp.add_argument("trace", nargs="?", default="keywordToT", metavar="TRACE",
                    help="a reasoning JSON file, or a task name under the recorded workloads: "
                    "keywordToT (default), docmergeToT, sorting128ToT")
    rp.add_argument("--workloads", metavar="DIR",
                    help="recorded workloads directory (default: $DEFT_WORKLOADS or ../shared/workloads)")
    rp.add_argument("--record", type=int, default=0, help="index among the complete records (default 0)")
    rp.add_argument("--iterations", type=int, metavar="N", help="stop after N iterations (default: all)")
    rp.add_argument("--tokens", choices=["random", "greedy"], default="random",
                    help="decoded token ids: random (default) or greedy")
    rp.add_argument("--json", action="store_true", help="print the report as one JSON object")
    rp.set_defaults(func=cmd_replay)

    demo = sub.add_parser("demo", parents=[model], help="run the main demo on CPU",
                          description="Beam search, parallel sampling and speculative decoding "
                          "with SmolLM2 on built-in prompts (texts, tokens/s, KV bytes DeFT reads "
                          "against per-branch decoding), then the attention core on a few-shot "
                          "tree (4,000-token prompt, 20 branches of 200 tokens) checked against "
                          "dense attention.")
    demo.add_argument("--core", action="store_true", help="only the attention-core part (no model)")
    demo.set_defaults(func=cmd_demo)

    bench = sub.add_parser("bench", help="benchmarks (plan, attention, e2e)")
    bsub = bench.add_subparsers(dest="bench", required=True, metavar="BENCH")
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--workloads", metavar="DIR",
                        help="recorded workloads directory (default: $DEFT_WORKLOADS or ../shared/workloads)")
    common.add_argument("--workload", action="append", metavar="NAME",
                        help="run only this workload (repeatable); see deft.bench.trees.WORKLOADS")

    plan = bsub.add_parser("plan", parents=[common],
                           help="planning time per plan kind and of the triton step",
                           description="Median planning time of every plan kind on the benchmark "
                                       "trees, and of the triton backend's host-side step planning "
                                       "with numpy and with the compiled planner.")
    plan.add_argument("--block-kv", type=int, default=64, help="tile size in tokens (default 64)")
    plan.add_argument("--reps", type=int, default=50, help="timed repetitions (default 50)")
    plan.set_defaults(func=cmd_bench_plan)

    att = bsub.add_parser("attention", parents=[common], help="DeFT against tree-attention peers",
                          description="One layer (cpu) or a 32-layer decode step (cuda) of "
                          "Llama-3-8B-shaped attention: DeFT against per-query decoding, SDPA "
                          "and FlexAttention, measured side by side in one process.")
    att.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    att.add_argument("--reps", type=int, default=10, help="timed repetitions on CPU (default 10)")
    att.add_argument("--no-flex", action="store_true", help="skip FlexAttention (its compile is slow)")
    att.add_argument("--out", metavar="DIR", help="(cuda) also write JSON details here")
    att.set_defaults(func=cmd_bench_attention)

    e2e = bsub.add_parser("e2e", help="the engine against transformers generate (SmolLM2)",
                          description="End to end on one machine: DeFT's engine against "
                          "transformers generate with SmolLM2-135M-Instruct from the same GGUF: "
                          "greedy decoding (one prompt, a batch, a shared few-shot prompt) and "
                          "beam search k=4; tokens/s, speed-up, same-token check and where "
                          "DeFT's time goes.")
    e2e.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    e2e.add_argument("--reps", type=int, default=3, help="timed runs of each side (best counts, default 3)")
    e2e.add_argument("--workload", action="append", metavar="NAME",
                     help="run only this workload (repeatable); see deft.bench.e2e_bench.WORKLOADS")
    e2e.add_argument("--threads", type=int, help="torch threads (default: torch's choice)")
    e2e.add_argument("--speculative", action="store_true",
                     help="also speculative decoding against greedy decoding (deft.bench.spec_bench)")
    e2e.set_defaults(func=cmd_bench_e2e)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        args.func(args)
    except CliError as exc:
        print(f"deft: error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
