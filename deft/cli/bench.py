"""``deft bench plan|attention|e2e|serve``: the benchmarks, run from the ``benchmarks`` package."""

from __future__ import annotations

import argparse
import functools
import os
import tempfile
from typing import Any, Callable

from . import common
from .common import CliError, in_range

__all__ = ["add_parser"]

APPEND_HELP = ("with --json: join this run's rows to the record already at PATH (the same machine "
               "and commit; trees run in separate processes make one record), or start it")


def add_parser(subparsers: Any) -> None:
    """Add ``bench`` and its subcommands to ``deft``'s subcommands."""
    bench = subparsers.add_parser("bench", help="benchmarks (plan, attention, e2e, serve, tp)")
    bsub = bench.add_subparsers(dest="bench", required=True, metavar="BENCH")
    shared = argparse.ArgumentParser(add_help=False)
    common.add_workloads_flag(shared)
    shared.add_argument("--workload", action="append", metavar="NAME",
                        help="run only this workload (repeatable); see benchmarks.trees.WORKLOADS")
    shared.add_argument("--json", metavar="PATH",
                        help="also write the result as JSON (machine, commit, date, command, rows)")
    shared.add_argument("--append", action="store_true", help=APPEND_HELP)

    plan = bsub.add_parser("plan", parents=[shared],
                           help="planning time per plan kind and of the triton step",
                           description="Median planning time of every plan kind on the benchmark "
                                       "trees, and of the triton backend's host-side step planning "
                                       "with numpy and with the compiled planner.")
    plan.add_argument("--block-kv", type=int, default=64, help="tile size in tokens (default 64)")
    plan.add_argument("--reps", type=int, default=50, help="timed repetitions (default 50)")
    plan.set_defaults(func=_appending(run_plan))

    att = bsub.add_parser("attention", parents=[shared], help="DeFT against tree-attention peers",
                          description="One layer (cpu) or a 32-layer decode step (cuda) of "
                          "Llama-3-8B-shaped attention: DeFT against per-query decoding, SDPA "
                          "and FlexAttention, measured side by side in one process.")
    att.add_argument("--device", choices=common.DEVICES, default="cpu")
    att.add_argument("--reps", type=int, default=10, help="timed repetitions on CPU (default 10)")
    att.add_argument("--no-flex", action="store_true", help="skip FlexAttention (its compile is slow)")
    att.add_argument("--out", metavar="DIR", help="(cuda) also write JSON details here")
    att.add_argument("--kv-dtype", choices=("auto", "fp8_e4m3"), default="auto",
                     help="(cuda) fp8_e4m3: also DeFT-Flatten over FP8 copies of the K/V (per-head "
                     "scales), next to bf16, with the FP8 floor (default auto: bf16 only)")
    att.set_defaults(func=_appending(run_attention))

    e2e = bsub.add_parser("e2e", help="the engine end to end, against per-branch decoding and "
                          "transformers generate",
                          description="End to end on one machine. On cpu: DeFT's engine against "
                          "transformers generate with SmolLM2-135M-Instruct from the same GGUF: "
                          "greedy decoding (one prompt, a batch, a shared few-shot prompt) and "
                          "beam search k=4; tokens/s, speed-up, same-token check and where "
                          "DeFT's time goes. On cuda: a Llama-3-8B-shaped model with random bf16 "
                          "weights, the paper's workloads (parallel sampling b=20/30/50 from a "
                          "4,000-token prompt, beam search k=4/8/16, Medusa tree verification, "
                          "trace replay of the recorded reasoning trees, greedy decoding) with "
                          "steps replayed as CUDA graphs, launched eagerly and with per-branch "
                          "attention, against transformers and the step's floor "
                          "(benchmarks.e2e_gpu).")
    e2e.add_argument("--device", choices=common.DEVICES, default="cpu")
    e2e.add_argument("--reps", type=int, default=3,
                     help="(cpu) timed runs of each side (best counts, default 3)")
    e2e.add_argument("--workload", action="append", metavar="NAME",
                     help="run only this workload (repeatable); see benchmarks.e2e.WORKLOADS "
                     "(cpu) and benchmarks.e2e_gpu.GPU_WORKLOADS (cuda)")
    e2e.add_argument("--threads", type=int, help="torch threads (default: torch's choice)")
    e2e.add_argument("--speculative", action="store_true",
                     help="also speculative decoding against greedy decoding (benchmarks.speculative)")
    e2e.add_argument("--json", metavar="PATH", help="also write the result as JSON (machine, commit, "
                     "date, command, rows; with --speculative also PATH_speculative.json)")
    e2e.add_argument("--shape", choices=("llama-3-8b", "qwen3-8b"), default="llama-3-8b",
                     help="(cuda) the random model's shapes (default llama-3-8b)")
    e2e.add_argument("--layers", type=int,
                     help="(cuda) layers of the model (default: all of the shape's)")
    e2e.add_argument("--no-transformers", action="store_true",
                     help="(cuda) skip transformers generate")
    e2e.add_argument("--unfused", action="store_true",
                     help="(cuda) also the graph engine with the plain PyTorch ops instead of the fused kernels")
    e2e.add_argument("--kv-dtype", choices=("auto", "fp8_e4m3"), default="auto",
                     help="(cuda) fp8_e4m3: also the graph engine with an FP8 K/V cache (default "
                     "auto: the model's dtype only)")
    e2e.add_argument("--append", action="store_true", help=APPEND_HELP)
    common.add_workloads_flag(e2e)
    e2e.set_defaults(func=_appending(run_e2e))

    srv = bsub.add_parser(
        "serve", parents=[common.model_flags("SmolLM2-135M-Instruct GGUF on cpu, random:llama-3-8b on cuda",
                                             common.SERVER_CALIBRATION, tensor_parallel=False)],
        help="deft serve under concurrent load, against the library one request at a time",
        description="Start deft serve on 127.0.0.1 (a free port; stopped at the end, on errors and "
        "on Ctrl-C), replay a fixed mix of chat requests (a shared system prompt and different "
        "questions; streamed greedy and seeded sampled completions, n=4 sampling and beam search "
        "k=4) at each concurrency level, and report tokens/s, client-side time to first token and "
        "inter-token latency (p50/p99, streamed requests) and the prefix-cache hit rate (from "
        "/metrics); then the same requests one by one through the library in this process. "
        "Without --model: SmolLM2-135M-Instruct on cpu; on cuda random:llama-3-8b, random bf16 "
        "weights of Llama-3-8B's shapes with a byte-level tokenizer (as bench e2e --device cuda; "
        "no checkpoint needed).")
    srv.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32], metavar="N",
                     help="concurrent clients, one level each (default 1 8 32)")
    srv.add_argument("--requests", type=int, default=32, metavar="N",
                     help="requests per level (default 32)")
    srv.add_argument("--max-tokens", type=int, default=16, metavar="N",
                     help="max_tokens of every request (default 16)")
    srv.add_argument("--system-bytes", type=int, default=0, metavar="N",
                     help="repeat the system prompt's examples until it holds N bytes: as many "
                     "tokens of a random model's byte-level tokenizer, e.g. 4000 for 4,000-token "
                     "prompts (default: the examples once)")
    srv.add_argument("--num-pages", type=int, metavar="N",
                     help="KV cache pages of the server and the library's engine (default: deft serve's)")
    srv.add_argument("--max-running", type=int, metavar="N",
                     help="the server's --max-running (default: deft serve's)")
    srv.add_argument("--threads", type=int, metavar="N",
                     help="torch threads of the server and of the library run (default: torch's choice)")
    srv.add_argument("--json", metavar="PATH",
                     help="also write the result as JSON (machine, commit, date, command, rows)")
    srv.set_defaults(func=run_serve)

    tp = bsub.add_parser(
        "tp", help="tensor parallelism: the engine at each size, one torchrun job per size",
        description="For each --sizes N, a torchrun --nproc-per-node N job on this machine "
        "(gloo on cpu, NCCL on cuda): parallel sampling of --branches sequences from one "
        "--prompt-tokens prompt (tokens/s end to end, decode step time) and the verification of "
        "a --draft-tokens draft tree (time per forward), with the all-reduce time of a step's "
        "layers measured apart. On cpu the ranks share the cores: the table shows the "
        "collectives' overhead. Without --model: SmolLM2-135M-Instruct on cpu, random:llama-3-8b "
        "(random bf16 weights of Llama-3-8B's shapes) on cuda.")
    tp.add_argument("--device", choices=common.DEVICES, default="cpu")
    tp.add_argument("--model", metavar="MODEL", help="GGUF file, Hugging Face directory or "
                    "random:NAME[:layers=N] (default: see above)")
    tp.add_argument("--sizes", type=int, nargs="+", default=[1, 2], metavar="N",
                    help="tensor-parallel sizes (default 1 2; cuda: at most the GPUs there)")
    tp.add_argument("--prompt-tokens", type=int, metavar="N",
                    help="the shared prompt's tokens (default 400 on cpu, 4000 on cuda)")
    tp.add_argument("--branches", type=int, default=20, metavar="N", help="sampled branches (default 20)")
    tp.add_argument("--new-tokens", type=int, metavar="N",
                    help="tokens per branch (default 16 on cpu, 128 on cuda)")
    tp.add_argument("--draft-tokens", type=int, metavar="N",
                    help="draft-tree tokens (default 64 on cpu, 256 on cuda)")
    tp.add_argument("--reps", type=int, default=5, help="timed tree verifications (default 5)")
    tp.add_argument("--json", metavar="PATH",
                    help="also write the result as JSON (machine, commit, date, command, rows)")
    tp.set_defaults(func=run_tp)


def _appending(run: Callable[[argparse.Namespace], None]) -> Callable[[argparse.Namespace], None]:
    """``run`` with ``--append``: the benchmark writes its record to a temporary file, which
    is then joined to the record at ``--json`` (``benchmarks.report.join_records``)."""
    @functools.wraps(run)
    def wrapped(args: argparse.Namespace) -> None:
        if not args.append:
            run(args)
            return
        from benchmarks.report import (append_record, current_commit, load_record, record_commit,
                                       write_record)

        target = args.json
        if not target:
            raise CliError("--append: joins this run's record to the one at --json PATH; give --json")
        if getattr(args, "speculative", False):
            raise CliError("--append: not with --speculative (it writes a second record)")
        if os.path.exists(target):
            try:
                commit = record_commit(target)
            except (OSError, ValueError) as exc:
                raise CliError(f"--append: {target} holds no result record to join: {exc}") from exc
            here = current_commit()
            if commit is not None and commit != here:
                raise CliError(f"--append: {target} holds a run of commit {commit}, this checkout "
                               f"is {here}: a record is one commit's")
        with tempfile.TemporaryDirectory() as tmp:
            args.json = os.path.join(tmp, "run.json")
            try:
                run(args)
                if not os.path.isfile(args.json):
                    return
                rec = load_record(args.json)
            finally:
                args.json = target
            try:
                append_record(target, rec)
            except (OSError, ValueError) as exc:
                stem, n = target.removesuffix(".json"), 1
                kept = f"{stem}.run.json"
                while os.path.exists(kept):  # an earlier failed join's record stays too
                    n += 1
                    kept = f"{stem}.run{n}.json"
                write_record(kept, rec)
                raise CliError(f"--append: {exc}; this run's record is in {kept}") from exc
    return wrapped


def run_plan(args: argparse.Namespace) -> None:
    from benchmarks.plan import plan_table

    print(plan_table(args.workload or None, common.workloads(args.workloads), args.block_kv, args.reps,
                     json_path=args.json))


def run_attention(args: argparse.Namespace) -> None:
    if args.device == "cuda":
        common.require_device(args.device)
        from benchmarks.attention_gpu import gpu_attention_report

        print(gpu_attention_report(args.workload or None, common.workloads(args.workloads),
                                   out=args.out, progress=common.progress, json_path=args.json,
                                   flex=not args.no_flex, kv_dtype=args.kv_dtype))
        return
    if args.kv_dtype != "auto":
        raise CliError("--kv-dtype: applies to --device cuda only")
    from benchmarks.attention_cpu import cpu_attention_table

    print(cpu_attention_table(args.workload or None, common.workloads(args.workloads),
                              flex=not args.no_flex, reps=args.reps, progress=common.progress,
                              json_path=args.json))


def run_e2e(args: argparse.Namespace) -> None:
    import torch

    common.require_device(args.device)
    if args.device == "cuda":
        run_gpu_e2e(args)
        return
    for flag, given in (("--kv-dtype", args.kv_dtype != "auto"), ("--shape", args.shape != "llama-3-8b"),
                        ("--layers", args.layers is not None)):
        if given:
            raise CliError(f"{flag}: applies to --device cuda only")
    from benchmarks.e2e import WORKLOADS, e2e_table

    known = [w.name for w in WORKLOADS]
    for name in args.workload or []:
        if name not in known:
            raise CliError(f"--workload: expected one of {', '.join(map(repr, known))}, got {name!r}")
    in_range(args.reps, "--reps", 1, 100)
    if args.threads is not None:
        torch.set_num_threads(in_range(args.threads, "--threads", 1, 1024))
    print(e2e_table(args.device, args.workload, args.reps, progress=common.progress, json_path=args.json),
          flush=True)
    if args.speculative:
        from benchmarks.speculative import spec_table

        spec_json = args.json and args.json.removesuffix(".json") + "_speculative.json"
        print()
        print(spec_table(device=args.device, reps=args.reps, progress=common.progress, json_path=spec_json))


def run_gpu_e2e(args: argparse.Namespace) -> None:
    from benchmarks.e2e_gpu import GPU_WORKLOADS, gpu_e2e_table

    known = [w.name for w in GPU_WORKLOADS]
    for name in args.workload or []:
        if name not in known:
            raise CliError(f"--workload: expected one of {', '.join(map(repr, known))}, got {name!r}")
    for flag, given in (("--reps", args.reps != 3), ("--threads", args.threads is not None),
                        ("--speculative", args.speculative)):
        if given:
            raise CliError(f"{flag}: applies to --device cpu only")
    from deft.model.synthetic import SHAPES

    if args.layers is not None:
        in_range(args.layers, "--layers", 1, SHAPES[args.shape].num_layers)
    print(gpu_e2e_table(args.workload, common.workloads(args.workloads), args.layers,
                        not args.no_transformers, args.unfused, progress=common.progress,
                        json_path=args.json, kv_dtype=args.kv_dtype, shape=args.shape),
          flush=True)


def run_serve(args: argparse.Namespace) -> None:
    from benchmarks.serve import ServerError, serve_table

    from deft.model.synthetic import is_random_spec, parse_spec

    if args.tensor_parallel_size != 1:
        raise CliError("--tensor-parallel-size: bench serve starts one server process; run "
                       "deft serve --tp N under torchrun and load it yourself")
    common.require_device(args.device)
    if args.num_pages is not None and args.kv_memory is not None:
        raise CliError("--kv-memory: give either --kv-memory or --num-pages, not both")
    if is_random_spec(args.model):
        try:
            parse_spec(args.model)
        except ValueError as exc:
            raise CliError(f"--model: {exc}") from exc
    levels = [in_range(c, "--concurrency", 1, 256) for c in args.concurrency]
    try:
        print(serve_table(levels, in_range(args.requests, "--requests", 1, 1024),
                          in_range(args.max_tokens, "--max-tokens", 1, 1024), args.model, args.device, args.dtype,
                          args.num_pages and in_range(args.num_pages, "--num-pages", 1, 1 << 26),
                          args.kv_memory, args.max_running and in_range(args.max_running, "--max-running", 1, 4096),
                          args.threads and in_range(args.threads, "--threads", 1, 1024),
                          progress=common.progress, json_path=args.json, kv_dtype=args.kv_dtype,
                          system_bytes=in_range(args.system_bytes, "--system-bytes", 0, 1 << 24)),
              flush=True)
    except ServerError as exc:
        raise CliError(str(exc)) from exc


def run_tp(args: argparse.Namespace) -> None:
    import torch

    from benchmarks.tp import tp_table

    common.require_device(args.device)
    cuda = args.device == "cuda"
    most = torch.cuda.device_count() if cuda else 64
    sizes = [in_range(n, "--sizes", 1, most) for n in args.sizes]
    model = args.model or ("random:llama-3-8b" if cuda else None)
    if model is None:
        from deft.model.loader import default_model_path

        try:
            model = default_model_path()
        except FileNotFoundError as exc:
            raise CliError(f"--model: {exc}") from exc
    prompt = in_range(args.prompt_tokens or (4000 if cuda else 400), "--prompt-tokens", 2, 1 << 20)
    new = in_range(args.new_tokens or (128 if cuda else 16), "--new-tokens", 2, 1 << 16)
    draft = in_range(args.draft_tokens or (256 if cuda else 64), "--draft-tokens", 1, 4096)
    branches = in_range(args.branches, "--branches", 1, 4096)
    pages = common.pages_for(prompt + branches * (new + common.PAGE_SIZE) + draft) * 2 + 16
    try:
        print(tp_table(sizes, model, args.device, prompt, branches, new, draft,
                       in_range(args.reps, "--reps", 1, 1000), pages, progress=common.progress,
                       json_path=args.json), flush=True)
    except RuntimeError as exc:
        raise CliError(str(exc)) from exc
