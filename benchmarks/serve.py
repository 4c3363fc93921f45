"""``deft bench serve``: the OpenAI-compatible server under load, against the library.

The benchmark starts ``deft serve`` as a subprocess on 127.0.0.1 (a free port), waits for
``/health`` and always stops it (SIGTERM, then a kill after :data:`STOP_S`), also on errors,
Ctrl-C and a SIGTERM of its own. It replays the same deterministic mix of chat requests at
each concurrency level (a closed loop: that many clients, each sending its next request
when the last one is answered): one shared system prompt (quiz examples; ~290 tokens of
SmolLM2, ~1,000 of the byte-level tokenizer of a random model) and a question per request,
cycling through

- greedy and seeded sampled completions (temperature 0.8), **streamed**: the client times the
  first chunk with text (TTFT, from sending the request) and the gaps between chunks with
  text (ITL; one chunk per decode step);
- ``n=4`` seeded samples and beam search with 4 beams (the ``use_beam_search`` extra; it
  joins the running batch, a step of its beams in the same forward as the others), not
  streamed.

One warm-up request (another question) comes first, so the system prompt is in the prefix
cache before the first level; the same prompts recur at every level. On CUDA the whole mix
then runs once untimed at the highest level (and the library's batch once before its timed
one): the levels time the steady state, not the first compilation of the kernels of each step
shape and the capture of their CUDA graphs. Throughput is all
completion tokens of a level over its wall time; the prefix-cache hit rate and the share of
prompt tokens computed are differences of ``/metrics`` across the level. Last, the model is
loaded in this process (after the server has stopped) and the same requests run one by one
through the library's strategies (``generate``, ``sample``, ``beam_search``) on a
``TreeEngine`` built as the server builds it, with no prefix cache, then all together as one
batch (the offline rate: a pool that holds them all, a prefix cache holding the system prompt
from a warm-up request; the server's also holds the earlier passes' prompts and answers, which
spares it each question's few tokens); only token counts and time are compared, not texts.

The model is ``--model``'s, by default SmolLM2-135M-Instruct on CPU and on CUDA
:data:`GPU_MODEL`, random weights of Llama-3-8B's shapes (:mod:`deft.model.synthetic`), which
need no checkpoint: random weights cost what trained ones do per token, and greedy and
seeded requests stay deterministic.
"""

from __future__ import annotations

import asyncio
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Coroutine, Sequence, TypeVar

import numpy as np

from .e2e import FEW_SHOT, QUESTIONS
from .report import markdown_table, record, write_record

__all__ = ["BenchRequest", "ServerError", "ServerProcess", "request_mix", "serve_table"]

T = TypeVar("T")

GPU_MODEL = "random:llama-3-8b"
SYSTEM = "Answer the question in one short sentence, as in these examples.\n\n" + FEW_SHOT
WARM_UP = "What colour is the sky on a clear day?"
KINDS = ("greedy", "sampled", "n", "beam", "greedy", "sampled", "greedy", "sampled")
WIDTH = 4  # samples of an "n" request, beams of a "beam" request
TEMPERATURE = 0.8
STARTUP_S = 300.0  # loading the model (a large one on a GPU) may take minutes
STOP_S = 20.0  # the server lets running requests finish for up to 5 s, then cancels them
REQUEST_S = 600.0


class ServerError(RuntimeError):
    """The server did not start, or stopped during the benchmark."""


@dataclass(frozen=True)
class BenchRequest:
    """One chat request of the mix: ``kind`` is ``greedy``, ``sampled`` (both streamed),
    ``n`` (``WIDTH`` seeded samples) or ``beam`` (``WIDTH`` beams, the best returned)."""

    question: str
    kind: str
    max_tokens: int
    seed: int | None = None
    system: str = SYSTEM

    @property
    def stream(self) -> bool:
        return self.kind in ("greedy", "sampled")

    @property
    def messages(self) -> list[dict[str, str]]:
        return [{"role": "system", "content": self.system}, {"role": "user", "content": self.question}]


def system_prompt(min_bytes: int = 0) -> str:
    """:data:`SYSTEM`, its examples repeated until it holds at least ``min_bytes`` UTF-8
    bytes (as many tokens of the random models' byte-level tokenizer)."""
    text = SYSTEM
    while len(text.encode()) < min_bytes:
        text += FEW_SHOT
    return text


def request_mix(count: int, max_tokens: int, system: str = SYSTEM) -> list[BenchRequest]:
    """The first ``count`` requests of the mix (every kind within the first four), each with
    the system prompt ``system``."""
    out = []
    for i in range(count):
        kind = KINDS[i % len(KINDS)]
        question = QUESTIONS[(i + i // len(KINDS)) % len(QUESTIONS)]
        out.append(BenchRequest(question, kind, max_tokens, seed=i if kind in ("sampled", "n") else None,
                                system=system))
    return out


@dataclass
class Outcome:
    """What the client saw of one request: ``ttft`` and ``gaps`` (s) only when streamed."""

    tokens: int = 0
    prompt_tokens: int = 0
    ttft: float | None = None
    gaps: list[float] = field(default_factory=list)
    error: str | None = None


# ------------------------------------------------------------------ the server


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _Sigterm:
    """The bench's SIGTERM handler: ``SystemExit(128 + SIGTERM)``, as Ctrl-C unwinds. While
    :meth:`run` drives a replay it cancels the replay instead and raises once ``asyncio.run``
    has returned: an exception raised at an arbitrary point of the event loop's machinery
    (its clean-up, an executor's shutdown) can leave the process stuck."""

    def __init__(self) -> None:
        self.task: asyncio.Task | None = None
        self.hit = False

    def __call__(self, signum: int, frame: object) -> None:
        task = self.task
        if task is None or task.get_loop().is_closed():
            raise SystemExit(128 + signum)
        self.hit = True
        task.get_loop().call_soon_threadsafe(task.cancel)

    def run(self, coro: Coroutine[Any, Any, T]) -> T:
        """``asyncio.run(coro)``, which a SIGTERM cancels."""
        async def main() -> T:
            self.task = asyncio.current_task()
            return await coro

        try:
            out = asyncio.run(main())
        except asyncio.CancelledError:
            if not self.hit:
                raise
        finally:
            self.task = None
        if self.hit:  # also when the signal came after the replay's end
            raise SystemExit(128 + signal.SIGTERM)
        return out


_SIGTERM = _Sigterm()


class ServerProcess:
    """``deft serve FLAGS`` on 127.0.0.1 as a context manager: entered once ``/health``
    answers (:class:`ServerError` past ``startup_s`` or if it exits), stopped on exit;
    ``threads``: its torch threads (``OMP_NUM_THREADS``), else torch's choice."""

    def __init__(self, flags: Sequence[str], startup_s: float = STARTUP_S,
                 progress: Callable[[str], None] | None = None, threads: int | None = None) -> None:
        self.flags, self.startup_s = list(flags), startup_s
        self.env = None if threads is None else {**os.environ, "OMP_NUM_THREADS": str(threads)}
        self.say = progress or (lambda msg: None)
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen | None = None
        self._log = tempfile.TemporaryFile(mode="w+")
        self._on_sigterm: Any = None

    def __enter__(self) -> "ServerProcess":
        if threading.current_thread() is threading.main_thread():  # SIGTERM unwinds, as Ctrl-C does
            self._on_sigterm = signal.signal(signal.SIGTERM, _SIGTERM)
        cmd = [sys.executable, "-m", "deft.cli", "serve", "--host", "127.0.0.1", "--port", str(self.port),
               *self.flags]
        self.proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                     stderr=self._log, env=self.env)
        self.say(f"deft serve (pid {self.proc.pid}) starting on {self.url}")
        try:
            self._wait_healthy()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _wait_healthy(self) -> None:
        import httpx

        deadline = time.monotonic() + self.startup_s
        while time.monotonic() < deadline:
            self.check_alive()
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.25)
        raise ServerError(f"deft serve did not answer /health within {self.startup_s:g} s")

    def check_alive(self) -> None:
        """:class:`ServerError` with the end of the server's stderr if it has exited."""
        if self.proc is not None and self.proc.poll() is not None:
            raise ServerError(f"deft serve exited with status {self.proc.returncode}: {self.log_tail()}")

    def log_tail(self, chars: int = 2000) -> str:
        self._log.seek(0)
        return self._log.read()[-chars:].strip()

    def stop(self) -> None:
        """SIGTERM, then SIGKILL if it is still there after :data:`STOP_S`; idempotent."""
        proc = self.proc
        if proc is None:
            return
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(STOP_S)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(STOP_S)
        self._log.close()
        self.say(f"deft serve (pid {proc.pid}) stopped ({proc.returncode})")
        self.proc = None
        if self._on_sigterm is not None:
            signal.signal(signal.SIGTERM, self._on_sigterm)
            self._on_sigterm = None

    def model_id(self) -> str:
        """The id of the model the server serves (``/v1/models``)."""
        import httpx

        return httpx.get(self.url + "/v1/models", timeout=10).json()["data"][0]["id"]

    def metrics(self) -> dict[str, float]:
        """The unlabelled samples of ``/metrics``, by name."""
        import httpx

        text = httpx.get(self.url + "/metrics", timeout=10).text
        return {m.group(1): float(m.group(2)) for m in re.finditer(r"^([a-z_]+) (\S+)$", text, re.M)}

    def idle_metrics(self, timeout: float = 30.0) -> dict[str, float]:
        """:meth:`metrics` once nothing runs or waits (the scheduler has counted its last step)."""
        deadline = time.monotonic() + timeout
        while True:
            m = self.metrics()
            if m["deft_num_requests_running"] == m["deft_num_requests_waiting"] == 0 or time.monotonic() > deadline:
                return m
            time.sleep(0.05)


# ------------------------------------------------------------------ the client


async def _send(client: Any, model: str, req: BenchRequest) -> Outcome:
    """Send ``req``; its completion tokens, and TTFT and ITL gaps when streamed."""
    kw: dict[str, Any] = {"model": model, "messages": req.messages, "max_tokens": req.max_tokens}
    if req.kind == "greedy":
        kw["temperature"] = 0
    elif req.kind in ("sampled", "n"):
        kw.update(temperature=TEMPERATURE, seed=req.seed, n=WIDTH if req.kind == "n" else 1)
    else:
        kw.update(temperature=0, extra_body={"use_beam_search": True, "best_of": WIDTH})
    t0 = time.perf_counter()
    if not req.stream:
        out = await client.chat.completions.create(**kw)
        return Outcome(out.usage.completion_tokens, out.usage.prompt_tokens)
    outcome, last = Outcome(), None
    stream = await client.chat.completions.create(**kw, stream=True, stream_options={"include_usage": True})
    async for chunk in stream:
        if chunk.usage is not None:
            outcome.tokens, outcome.prompt_tokens = chunk.usage.completion_tokens, chunk.usage.prompt_tokens
        if not chunk.choices or not chunk.choices[0].delta.content:
            continue
        now = time.perf_counter()
        if last is None:
            outcome.ttft = now - t0
        else:
            outcome.gaps.append(now - last)
        last = now
    return outcome


async def _replay(url: str, model: str, reqs: list[BenchRequest], concurrency: int,
                  say: Callable[[str], None]) -> tuple[list[Outcome], float]:
    """``reqs`` sent by ``concurrency`` clients; the outcomes in order and the wall time (s)."""
    from openai import AsyncOpenAI

    outcomes: list[Outcome | None] = [None] * len(reqs)
    todo = iter(range(len(reqs)))
    done = [0]
    every = max(1, len(reqs) // 4)

    async def client_loop(client: Any) -> None:
        for i in todo:
            try:
                outcomes[i] = await _send(client, model, reqs[i])
            except Exception as exc:  # a failed request is counted, not fatal
                outcomes[i] = Outcome(error=f"{type(exc).__name__}: {exc}")
                say(f"request {i} ({reqs[i].kind}) failed: {outcomes[i].error}")
            done[0] += 1
            if done[0] % every == 0 or done[0] == len(reqs):
                say(f"concurrency {concurrency}: {done[0]}/{len(reqs)} requests")

    async with AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=REQUEST_S) as client:
        t0 = time.perf_counter()
        await asyncio.gather(*(client_loop(client) for _ in range(min(concurrency, len(reqs)))))
        wall = time.perf_counter() - t0
    return [o for o in outcomes if o is not None], wall


def _ms(values: list[float], q: float) -> float:
    return 1e3 * float(np.percentile(values, q)) if values else float("nan")


def _ratio(num: float, den: float) -> float:
    return num / den if den else float("nan")


# ------------------------------------------------------------------ the library


@dataclass(frozen=True)
class LibraryRun:
    """The library's side: prompt tokens, the system prompt's tokens, completion tokens
    and seconds of the requests one by one and of all of them in one batch, and the
    batch's steps (all, graph-replayed)."""

    prompt_tokens: int
    system_tokens: int
    one_by_one: tuple[int, float]
    batched: tuple[int, float]
    batch_steps: tuple[int, int]  # the batch's steps and those replayed as CUDA graphs


def _library(model_path: str | None, device: str, dtype: str, num_pages: int,
             reqs: list[BenchRequest], say: Callable[[str], None], kv_dtype: str = "auto",
             max_batch: int | None = None, warm_pass: bool = False) -> LibraryRun:
    """``reqs`` through the library on ``num_pages`` pages (the server's pool, of the
    default page size as the server's), first one by one through the strategies
    (``generate``, ``sample``, ``beam_search``), then offline: all of them as one
    :func:`~deft.engine.decoding.decode` (at most ``max_batch`` running: the server's most
    concurrent level, or its ``--max-running`` if lower), each with its own sampling
    parameters and beams and their prompts shared through a prefix cache that the warm-up
    request filled, as the server runs them together, in a pool that holds them all at once;
    ``warm_pass``: after the same batch once, untimed, on the same engine."""
    from deft.engine import SamplingParams, TreeEngine, beam_search, generate, sample
    from deft.engine.beams import BeamParams
    from deft.engine.decoding import decode
    from deft.engine.requests import Request
    from deft.model import is_random_spec, load_model, load_random
    from deft.serve.prefix_cache import PrefixCache
    from deft.serve.scheduler import calibrate_kv

    model, tok = (load_random if is_random_spec(model_path) else load_model)(model_path, device, dtype)
    engine = TreeEngine(model, tok, num_pages=num_pages, device=device, prefill_chunk=256,
                        kv=kv_dtype)
    calibrate_kv(engine)  # as deft serve does

    def params(req: BenchRequest) -> SamplingParams:
        greedy = req.kind in ("greedy", "beam")
        return SamplingParams(temperature=0.0 if greedy else TEMPERATURE,
                              seed=None if greedy else req.seed, max_new_tokens=req.max_tokens)

    def run(req: BenchRequest) -> int:
        ids = tok.apply_chat_template(req.messages)
        if req.kind == "beam":
            return sum(len(h.token_ids) for h in beam_search(engine, [ids], WIDTH, req.max_tokens)[0])
        if req.kind == "n":
            return sum(len(r.token_ids) for r in sample(engine, [ids], WIDTH, params(req))[0])
        return len(generate(engine, [ids], params(req))[0].token_ids)

    def request(req: BenchRequest) -> Request:
        ids = tok.apply_chat_template(req.messages)
        if req.kind == "beam":
            beams = BeamParams(WIDTH, req.max_tokens)
            beams.check(engine)
            return Request(ids, WIDTH, params(req), pin_prompt=True, strategy=beams)
        return Request(ids, WIDTH if req.kind == "n" else 1, params(req), pin_prompt=True)

    def made(r: Request) -> int:
        if r.strategy is not None:
            return sum(len(h.token_ids) for h in r.search.results(tok, {}))
        return sum(len(b.tokens) for b in r.branches)

    say("library: warm-up")
    run(BenchRequest(WARM_UP, "greedy", reqs[0].max_tokens, system=reqs[0].system))
    say(f"library: {len(reqs)} requests one by one")
    tokens, every = 0, max(1, len(reqs) // 4)
    t0 = time.perf_counter()
    for i, req in enumerate(reqs, 1):
        tokens += run(req)
        if i % every == 0 or i == len(reqs):
            say(f"library: {i}/{len(reqs)} requests")
    one_by_one = (tokens, time.perf_counter() - t0)
    say(f"library: {len(reqs)} requests in one batch")
    batch = [request(req) for req in reqs]
    warm = request(BenchRequest(WARM_UP, "greedy", reqs[0].max_tokens, system=reqs[0].system))
    # A pool that holds every request at once: the offline rate, not the page pressure.
    need = sum(-(-(len(r.prompt) + WIDTH * (r.params.max_new_tokens + 16)) // 16) for r in [warm, *batch])
    engine = TreeEngine(model, tok, num_pages=max(num_pages, need), device=device,
                        prefill_chunk=256, kv=kv_dtype)
    calibrate_kv(engine)
    prefixes = PrefixCache(engine.cache)
    if warm_pass:
        say("library: warm-up pass")
        decode(engine, requests=[request(req) for req in reqs], max_batch=max_batch, prefixes=prefixes)
        prefixes.clear()
    decode(engine, requests=[warm], prefixes=prefixes)  # the system prompt cached, as the server's is
    before = dict(engine.stats)
    t0 = time.perf_counter()
    decode(engine, requests=batch, max_batch=max_batch, prefixes=prefixes)
    batched = (sum(made(r) for r in batch), time.perf_counter() - t0)
    steps = tuple(int(engine.stats[k] - before[k]) for k in ("steps", "graph_steps"))
    return LibraryRun(sum(len(r.prompt) for r in batch),
                      len(tok.encode(reqs[0].system, add_special_tokens=False)), one_by_one, batched,
                      steps)


# ------------------------------------------------------------------ the table


HEADERS = ["side", "concurrency", "requests", "completed", "prompt tokens", "completion tokens", "wall s",
           "tok/s", "x library", "x batch", "TTFT p50 ms", "TTFT p99 ms", "ITL p50 ms", "ITL p99 ms", "prefix hit rate",
           "prompt computed %"]


def serve_table(concurrency: Sequence[int] = (1, 8, 32), requests: int = 32, max_tokens: int = 16,
                model: str | None = None, device: str = "cpu", dtype: str = "auto",
                num_pages: int | None = None,
                kv_memory: int | None = None, max_running: int | None = None, threads: int | None = None,
                progress: Callable[[str], None] | None = None, json_path: str | None = None,
                startup_s: float = STARTUP_S, kv_dtype: str = "auto", system_bytes: int = 0) -> str:
    """Markdown table of the server at each ``concurrency`` and of the library, one request
    at a time and all in one batch (also written as a result record to ``json_path``, when
    given); ``model`` ``None``: the default model on CPU, :data:`GPU_MODEL` on CUDA;
    ``threads``: torch threads of the server and of this process, else torch's choice;
    ``kv_dtype``: both sides' ``--kv-dtype``; ``system_bytes``: the system prompt's size
    (:func:`system_prompt`)."""
    import torch

    say = progress or (lambda msg: None)
    load = os.getloadavg()[0]  # other work on the machine skews every figure
    reqs = request_mix(requests, max_tokens, system_prompt(system_bytes))
    if model is None and device == "cuda":
        model = GPU_MODEL
    flags = [*(["--model", model] if model else []), "--device", device, "--dtype", dtype,
             *(["--num-pages", str(num_pages)] if num_pages is not None else []),
             *(["--kv-memory", str(kv_memory)] if kv_memory is not None else []),
             *(["--max-running", str(max_running)] if max_running is not None else []),
             "--kv-dtype", kv_dtype]
    rows = []
    if threads is not None:
        torch.set_num_threads(threads)
    with ServerProcess(flags, startup_s, say, threads) as server:
        name, pool = server.model_id(), int(server.metrics()["deft_kv_pages_total"])
        say("warm-up request")
        warm_up = [BenchRequest(WARM_UP, "greedy", max_tokens, system=reqs[0].system)]
        (warm,), _ = _SIGTERM.run(_replay(server.url, name, warm_up, 1, lambda msg: None))
        if warm.error is not None:
            raise ServerError(f"the warm-up request failed: {warm.error}")
        if device == "cuda":
            say("warm-up pass")
            outcomes, _ = _SIGTERM.run(_replay(server.url, name, reqs, max(concurrency), lambda msg: None))
            failed = next((o.error for o in outcomes if o.error is not None), None)
            if failed is not None:
                raise ServerError(f"a request of the warm-up pass failed: {failed}")
        for c in concurrency:
            before = server.idle_metrics()
            outcomes, wall = _SIGTERM.run(_replay(server.url, name, reqs, c, say))
            server.check_alive()
            after = server.idle_metrics()
            delta = {k: after[k] - before[k] for k in after if k.endswith("_total")}
            ok = [o for o in outcomes if o.error is None]
            tokens = sum(o.tokens for o in ok)
            ttft = [o.ttft for o in ok if o.ttft is not None]
            gaps = [g for o in ok for g in o.gaps]
            rows.append(["server", c, len(reqs), len(ok), sum(o.prompt_tokens for o in ok), tokens, wall,
                         tokens / wall, None, None,
                         _ms(ttft, 50), _ms(ttft, 99), _ms(gaps, 50), _ms(gaps, 99),
                         _ratio(delta["deft_prefix_cache_hits_total"], delta["deft_prefix_cache_lookups_total"]),
                         100 * _ratio(delta["deft_prompt_tokens_computed_total"],
                                      delta["deft_prompt_tokens_total"])])
    width = min(c for c in (max(concurrency), max_running) if c is not None)
    lib = _library(model, device, dtype, pool, reqs, say, kv_dtype, width, warm_pass=device == "cuda")
    nan = float("nan")
    one_rate, batch_rate = (t / sec for t, sec in (lib.one_by_one, lib.batched))
    for row in rows:
        row[8], row[9] = row[7] / one_rate, row[7] / batch_rate
    for side, running, (tokens, sec), rate in (
            ("library, one by one", 1, lib.one_by_one, one_rate),
            ("library, one batch", width, lib.batched, batch_rate)):
        rows.append([side, running, len(reqs), len(reqs), lib.prompt_tokens, tokens, sec, rate,
                     rate / one_rate, rate / batch_rate, nan, nan, nan, nan, nan, nan])
    threads = torch.get_num_threads()  # the server's too: OMP_NUM_THREADS, or the same default
    mix = (f"chat: one {lib.system_tokens}-token system prompt + a question; of every 8 requests 3 greedy and 3 "
           f"sampled (T={TEMPERATURE}, seeded) streamed, 1 n={WIDTH} sampled, 1 beam search "
           f"k={WIDTH}; max_tokens {max_tokens}")
    if json_path:
        write_record(json_path, record(HEADERS, rows, device, model=name, threads=threads,
                                       requests=requests, max_tokens=max_tokens, mix=mix,
                                       load_average=round(load, 2),
                                       library_batch_steps=dict(zip(("steps", "graph_steps"), lib.batch_steps))))
    return (f"deft serve with {name} on {device} ({threads} torch threads each), {requests} "
            f"requests per level; {mix}.\n\n" + markdown_table(HEADERS, rows))
