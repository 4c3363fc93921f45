"""``deft serve``: the OpenAI-compatible HTTP server (:mod:`deft.serve`)."""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import socket
import sys
from pathlib import Path
from typing import Any

from . import common, parallel
from .common import CliError, in_range

__all__ = ["add_parser", "model_id", "run"]

DEFAULT_PAGES = 4096
MAX_REQUEST_BYTES = 16 << 20
MAX_DRAFT_TOKENS = 256


def add_parser(subparsers: Any) -> None:
    """Add the ``serve`` command to ``deft``'s subcommands."""
    p = subparsers.add_parser(
        "serve", parents=[common.model_flags(kv_calibration=common.SERVER_CALIBRATION)],
        help="an OpenAI-compatible server (continuous batching)",
        description="Serve the model over OpenAI's HTTP API (/v1/completions, /v1/chat/completions, "
        "/v1/models, /health, /metrics). One scheduler owns the engine: requests join the running "
        "batch at the next step, and prompts that share a prefix share its KV across requests.")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1, loopback)")
    p.add_argument("--port", type=int, default=8000,
                   help="default 8000; 0 picks a free port (printed); a port in use exits 2")
    p.add_argument("--api-key", metavar="KEY",
                   help="require 'Authorization: Bearer KEY' on /v1 routes (default: $DEFT_API_KEY, or none)")
    p.add_argument("--max-running", type=int, default=32, metavar="N",
                   help="prompts decoding at once (a request of several prompts counts each; "
                   "default 32)")
    p.add_argument("--max-queue", type=int, default=256, metavar="N",
                   help="prompts that may wait beyond --max-running (a request of several "
                   "prompts counts each); one more is HTTP 429 (default 256)")
    p.add_argument("--max-request-bytes", type=int, default=MAX_REQUEST_BYTES, metavar="N",
                   help=f"largest request body; beyond, HTTP 413 (default {MAX_REQUEST_BYTES >> 20} MiB)")
    p.add_argument("--max-draft-tokens", type=int, default=MAX_DRAFT_TOKENS, metavar="N",
                   help=f"largest speculative draft tree; beyond, HTTP 400 (default {MAX_DRAFT_TOKENS})")
    p.add_argument("--shutdown-timeout", type=float, default=5.0, metavar="S",
                   help="on SIGINT/SIGTERM, seconds running requests may take to finish before they "
                   "are ended with an error (default 5)")
    p.add_argument("--num-pages", type=int, metavar="N",
                   help=f"KV cache pages of {common.PAGE_SIZE} tokens (default {DEFAULT_PAGES}, or "
                   "as many as --kv-memory holds)")
    p.add_argument("--prefill-chunk", type=int, default=256, metavar="N",
                   help="prompt tokens per request per step (default 256)")
    p.add_argument("--draft-model", metavar="PATH",
                   help="draft model for speculative requests with drafter 'model' (same vocabulary)")
    p.add_argument("--no-prefix-cache", action="store_true",
                   help="do not keep finished prompts for later requests")
    p.set_defaults(func=run)


def model_id(path: str | None) -> str:
    """The id /v1/models gives the model at ``path``: its file name without the extension,
    or its directory's name (a trailing slash allowed); the default model's name for ``None``;
    a random-model spec as written canonically (``random:tiny``)."""
    from ..model.synthetic import is_random_spec, parse_spec

    if not path:
        return "SmolLM2-135M-Instruct"
    if is_random_spec(path):
        return str(parse_spec(path))
    p = Path(path.rstrip("/\\") or path)
    return p.stem if p.is_file() else p.name


def run(args: argparse.Namespace) -> None:
    """Load the model(s), start the scheduler and serve until SIGINT/SIGTERM, then drain (exit 0)."""
    port = in_range(args.port, "--port", 0, 65535)
    max_running = in_range(args.max_running, "--max-running", 1, 4096)
    max_queue = in_range(args.max_queue, "--max-queue", 0, 1 << 20)
    max_body = in_range(args.max_request_bytes, "--max-request-bytes", 1, 1 << 40)
    max_drafts = in_range(args.max_draft_tokens, "--max-draft-tokens", 1, 1 << 16)
    grace = args.shutdown_timeout
    if not 0 <= grace <= 3600:
        raise CliError(f"--shutdown-timeout: expected seconds in [0, 3600], got {grace}")
    if args.num_pages is not None and args.kv_memory is not None:
        raise CliError("--kv-memory: give either --kv-memory or --num-pages, not both")
    num_pages = in_range(DEFAULT_PAGES if args.num_pages is None else args.num_pages,
                         "--num-pages", 1, 1 << 26)
    chunk = in_range(args.prefill_chunk, "--prefill-chunk", 1, 1 << 16)
    try:
        import uvicorn

        from ..serve import DrainingServer, Metrics, Scheduler, create_app
    except ImportError as exc:
        raise CliError(f"deft serve needs the serve extra: pip install 'deft-llm[serve]' ({exc})") from exc
    from ..engine import ModelDrafter, NgramDrafter, TreeEngine

    try:  # before loading: a port in use fails at once (rank 0 alone listens under --tp)
        sock = (socket.create_server((args.host, port), family=socket.AF_INET6 if ":" in args.host
                                     else socket.AF_INET) if parallel.leads(args) else None)
    except OSError as exc:
        raise CliError(f"--port: could not listen on {args.host}:{port} ({exc.strerror or exc})") from exc
    with sock or contextlib.nullcontext():
        model, tok = parallel.load(args)
        draft = draft_tok = None
        if args.draft_model is not None and parallel.leads(args):  # rank 0 alone drafts
            draft, draft_tok = common.load_from(args.draft_model, args.device, "--draft-model",
                                                args.dtype)
        if args.kv_memory is not None:  # as many pages as the budget holds, shared like the CLI's
            models = [model] + ([draft] if draft is not None else [])
            num_pages, *draft_pages = common.KVBudget.of(args).pages([(m, 1 << 26) for m in models])
        else:
            draft_pages = [num_pages]
        engine = parallel.engine(args, model, tok, common.engine_config(
            num_pages, args.device, args.kv_dtype, prefill_chunk=chunk))
        drafters: dict[str, Any] = {"ngram": NgramDrafter}
        if draft is not None:
            draft_engine = TreeEngine(draft, draft_tok, common.engine_config(
                draft_pages[0], args.device, args.kv_dtype))
            drafters["model"] = lambda: ModelDrafter(draft_engine)
        name = model_id(args.model)
        scheduler = Scheduler(engine, max_running, max_queue, Metrics(),
                              prefix_cache=not args.no_prefix_cache, drafters=drafters)
        api_key = args.api_key if args.api_key is not None else os.environ.get("DEFT_API_KEY")
        app = create_app(scheduler, name, api_key, max_body, max_drafts)
        server = DrainingServer(uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=5), scheduler, grace)
        for sig in (signal.SIGINT, signal.SIGTERM):  # uvicorn re-raises a second signal once shut
            signal.signal(sig, lambda *_: None)       # down; after a clean shutdown it must not kill us
        scheduler.start()
        bound = sock.getsockname()[1]
        print(f"deft serve: {name} on http://{args.host}:{bound} ({engine!r})", file=sys.stderr, flush=True)
        try:
            server.run(sockets=[sock])
        finally:
            scheduler.stop()
        if scheduler.fatal is not None:  # printed by deft's main as one line, exit 1
            raise scheduler.fatal

