"""``deft serve`` under faults, as real processes of ``random:tiny`` on 127.0.0.1 (``--port 0``,
the port read from what the server prints): clients that leave, SIGTERM under load, bad
text, huge bodies, a full queue, unbounded draft trees, and the smaller API rules.

``random:tiny`` decodes a few hundred tokens a second here, so a request of 6,000 tokens
runs for many seconds: long enough to leave, or to be running when SIGTERM comes.
"""

from __future__ import annotations

import json
import re
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")

from test_serve import Server, running  # noqa: E402

MODEL = "random:tiny"
KEY = "sesame"
LONG = 6000  # tokens: tens of seconds of decoding


class TinyServer(Server):
    """``deft serve --model random:tiny --port 0 FLAGS``; ``port`` is the one it printed."""

    def __init__(self, *flags: str) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "deft.cli", "serve", "--model", MODEL, "--port", "0", *flags],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        for line in self.proc.stderr:
            if m := re.search(r"on http://127\.0\.0\.1:(\d+) ", line):
                self.port = int(m.group(1))
                break
        else:
            pytest.fail(f"deft serve exited with {self.proc.wait()} before printing its port")
        assert self.port != 0
        self.url = f"http://127.0.0.1:{self.port}"


def cancelled(server: Server) -> float:
    """Requests cancelled so far (the labelled counter appears at the first)."""
    text = httpx.get(server.url + "/metrics", timeout=10).text
    m = re.search(r'^deft_requests_total\{outcome="cancelled"\} (\S+)$', text, re.M)
    return float(m.group(1)) if m else 0.0


def body(max_tokens: int = LONG, **kw) -> dict:
    return {"model": MODEL, "prompt": "Once upon a time", "max_tokens": max_tokens, "temperature": 0, **kw}


@pytest.fixture(scope="module")
def servers():
    yield from running([TinyServer("--max-running", "2", "--max-queue", "2",
                                   "--max-request-bytes", "2000000", "--max-draft-tokens", "64"),
                        TinyServer("--max-running", "2", "--max-queue", "0", "--api-key", KEY)])


@pytest.fixture(scope="module")
def plain(servers):
    return servers[0]


@pytest.fixture(scope="module")
def keyed(servers):
    return servers[1]


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("which", ["plain", "keyed"])
def test_a_client_that_leaves_cancels_its_request_within_a_step(request, which, stream):
    server = request.getfixturevalue(which)
    headers = {"authorization": f"Bearer {KEY}"} if which == "keyed" else {}
    before = cancelled(server)
    start = time.monotonic()
    try:  # leave after a second: a timeout of the whole answer, or closing the stream
        with httpx.stream("POST", server.url + "/v1/completions", json=body(n=2, stream=stream),
                          headers=headers, timeout=1.0) as r:
            for _ in r.iter_bytes():
                if time.monotonic() - start > 1.0:
                    break
    except httpx.ReadTimeout:
        assert not stream
    left = time.monotonic()
    server.until("deft_num_requests_running", 0, timeout=5)
    assert time.monotonic() - left < 1.0
    assert cancelled(server) == before + 1
    generated = server.metric("deft_generation_tokens_total")
    time.sleep(0.3)
    assert server.metric("deft_generation_tokens_total") == generated


def test_a_lone_surrogate_is_a_400_naming_the_field(plain):
    raw = '{"model": "%s", "prompt": "a\\ud800b", "max_tokens": 2}' % MODEL
    r = httpx.post(plain.url + "/v1/completions", content=raw, headers={"content-type": "application/json"},
                   timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt", r.text
    raw = ('{"model": "%s", "max_tokens": 2, "messages": [{"role": "system", "content": "hi"}, '
           '{"role": "user", "content": [{"type": "text", "text": "x\\udfffy"}]}]}' % MODEL)
    r = httpx.post(plain.url + "/v1/chat/completions", content=raw,
                   headers={"content-type": "application/json"}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages[1].content", r.text


def test_tokenising_a_huge_prompt_leaves_the_loop_free_and_a_larger_body_is_413(plain):
    big = {"model": MODEL, "prompt": "tokens " * 250_000}  # 1.75 MB: seconds of tokenising
    answer = {}

    def post() -> None:
        start = time.monotonic()
        answer["r"] = httpx.post(plain.url + "/v1/completions", json=big, timeout=60)
        answer["s"] = time.monotonic() - start

    t = threading.Thread(target=post)
    t.start()
    waits = []
    while t.is_alive() and len(waits) < 20:
        start = time.monotonic()
        assert httpx.get(plain.url + "/health", timeout=10).status_code == 200
        waits.append(time.monotonic() - start)
        time.sleep(0.05)
    t.join(60)
    # A loop blocked by the tokenising would answer one probe only after all of it (the
    # request's time); a free loop answers each within a small part of it, however loaded.
    assert len(waits) >= 5 and max(waits) < min(0.5, answer["s"] / 3) + 0.25, (waits, answer["s"])
    assert answer["r"].status_code == 400 and answer["r"].json()["error"]["code"] == "context_length_exceeded"
    big["prompt"] += "x" * 300_000
    r = httpx.post(plain.url + "/v1/completions", json=big, timeout=60)
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large", r.text


def test_the_queue_counts_what_waits_beyond_the_running(plain, keyed):
    """--max-running 2 --max-queue 2: of six at once, four run or wait and two are 429s."""
    codes = []

    def ask() -> None:
        try:
            codes.append(httpx.post(plain.url + "/v1/completions", json=body(), timeout=3).status_code)
        except httpx.ReadTimeout:
            codes.append("left")

    threads = [threading.Thread(target=ask) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert sorted(map(str, codes)) == ["429", "429", "left", "left", "left", "left"]
    plain.until("deft_num_requests_running", 0)
    prompts = {"model": MODEL, "prompt": ["a", "b", "c", "d", "e"], "max_tokens": 1}
    r = httpx.post(plain.url + "/v1/completions", json=prompts, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt", r.text
    prompts["prompt"] = prompts["prompt"][:4]  # as many as run and wait: taken
    assert len(httpx.post(plain.url + "/v1/completions", json=prompts, timeout=30).json()["choices"]) == 4
    # --max-queue 0: nothing waits, but requests still run.
    out = keyed.client(api_key=KEY).completions.create(model=MODEL, prompt="Hi", max_tokens=2)
    assert out.choices[0].finish_reason == "length"


def test_a_draft_tree_beyond_max_draft_tokens_is_a_400(plain):
    client = plain.client()
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model=MODEL, prompt="a b a b a b", max_tokens=4, timeout=30,
                                  extra_body={"speculative": {"tree": {"k": 64, "depth": 1000, "width": 1000}}})
    assert err.value.body["param"] == "speculative.tree" and "64" in err.value.body["message"]
    out = client.completions.create(model=MODEL, prompt="a b a b a b", max_tokens=4, temperature=0,
                                    extra_body={"speculative": {"tree": {"k": 4, "depth": 8, "width": 8}}})
    assert out.usage.completion_tokens == 4


def test_stop_strings_with_beam_search_are_a_400(plain):
    with pytest.raises(openai.BadRequestError) as err:
        plain.client().completions.create(model=MODEL, prompt="Colours:", max_tokens=8, n=4, stop=["Blue"],
                                          extra_body={"use_beam_search": True})
    assert err.value.body["param"] == "stop"


def test_smaller_api_rules(plain):
    client = plain.client()
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}],
                                          max_tokens=10, max_completion_tokens=3, temperature=0)
    assert chat.usage.completion_tokens == 3
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}],
                                       max_tokens=2, top_logprobs=2)
    assert err.value.body["param"] == "top_logprobs"
    with pytest.raises(openai.NotFoundError) as err:
        client.completions.create(model="gpt-9", prompt="Hi", max_tokens=2)
    assert err.value.body["code"] == "model_not_found"
    assert client.models.retrieve(MODEL).id == MODEL
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-9")
    text = httpx.get(plain.url + "/metrics", timeout=10).text
    for name in ("deft_num_requests_running", "deft_num_requests_waiting", "deft_kv_cache_usage_perc",
                 "deft_time_to_first_token_seconds_count", "deft_e2e_request_latency_seconds_count",
                 "deft_request_queue_time_seconds_count"):
        assert re.search(rf"^{name} \S+$", text, re.M), name
    assert plain.metric("deft_e2e_request_latency_seconds_count") >= 1
    assert plain.metric("deft_request_queue_time_seconds_count") >= 1


def test_a_port_in_use_exits_2_at_once():
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        proc = subprocess.run([sys.executable, "-m", "deft.cli", "serve", "--model", MODEL, "--port", str(port)],
                              capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and f"--port: could not listen on 127.0.0.1:{port}" in proc.stderr


def test_sigterm_finishes_what_it_can_ends_the_rest_cleanly_and_exits_0():
    server = TinyServer("--shutdown-timeout", "3")
    server.wait()
    got: dict[str, object] = {}

    def whole(name: str, max_tokens: int) -> None:
        r = httpx.post(server.url + "/v1/completions", json=body(max_tokens), timeout=60)
        got[name] = (r.status_code, r.json())

    def streamed() -> None:
        with httpx.stream("POST", server.url + "/v1/completions", json=body(stream=True), timeout=60) as r:
            got["stream"] = [ln for ln in r.iter_lines() if ln]

    threads = [threading.Thread(target=whole, args=("long", LONG)), threading.Thread(target=streamed)]
    try:
        for t in threads:
            t.start()
        server.until("deft_num_requests_running", 2)
        threads.append(threading.Thread(target=whole, args=("short", 300)))
        threads[-1].start()
        server.until("deft_num_requests_running", 3)
        server.proc.send_signal(signal.SIGTERM)
        time.sleep(0.2)
        late = httpx.post(server.url + "/v1/completions", json=body(2), timeout=30)
        for t in threads:
            t.join(30)
        err = server.proc.communicate(timeout=30)[1]
    finally:
        server.stop()
    assert late.status_code == 503 and late.json()["error"]["type"] == "server_error"
    assert got["short"][0] == 200 and got["short"][1]["choices"][0]["finish_reason"] == "length"
    status, answer = got["long"]
    assert status == 503 and answer["error"]["message"] == "the server is shutting down"
    lines = got["stream"]
    assert lines[-1] == "data: [DONE]" and "error" in json.loads(lines[-2][6:]), lines[-3:]
    assert all("choices" in json.loads(ln[6:]) for ln in lines[:-2])
    assert server.proc.returncode == 0 and "Traceback" not in err, err


def test_a_drafters_default_tree_counts_against_max_draft_tokens():
    """Without ``speculative.tree`` the drafter's default tree runs: it is what is capped."""
    from deft.serve.protocol import CompletionRequest
    from deft.serve.requests import ApiError, Limits, _strategy

    body = CompletionRequest(model=MODEL, prompt="a b a b", max_tokens=4, speculative={})
    for cap, refused in ((16, True), (32, False)):
        limits = Limits(MODEL, 256, 64, 16, {"ngram": 32}, cap)
        if refused:
            with pytest.raises(ApiError, match="32 draft tokens \\(the ngram drafter's default tree\\)"):
                _strategy(body, 1, 1, None, limits)
        else:
            assert _strategy(body, 1, 1, None, limits) == ("speculative", {"drafter": "ngram", "tree": None})


def test_a_prompt_past_a_capped_context_is_a_400_naming_the_cap():
    """The context errors quote what capped the model's context (here its sliding window),
    as the engine's own errors do."""
    import asyncio

    from deft.model.config import LlamaConfig
    from deft.serve.protocol import CompletionRequest
    from deft.serve.requests import ApiError, Limits, completion_jobs

    cfg = LlamaConfig.from_hf_config({"vocab_size": 100, "hidden_size": 16, "intermediate_size": 32,
                                      "num_hidden_layers": 1, "num_attention_heads": 2,
                                      "max_position_embeddings": 256, "sliding_window": 32})
    limits = Limits(MODEL, cfg.max_position_embeddings, 64, 16, {}, None, cfg.context_text)

    class Tok:
        vocab_size = 100

    loop = asyncio.new_event_loop()
    try:
        for prompt, max_tokens, param in (([1] * 40, 2, "prompt"), ([1] * 30, 8, "max_tokens")):
            body = CompletionRequest(model=MODEL, prompt=prompt, max_tokens=max_tokens)
            with pytest.raises(ApiError, match="context of 32 \\(its sliding window") as err:
                completion_jobs(body, [prompt], None, limits, Tok(), asyncio.Queue(), loop, False)
            assert err.value.param == param
    finally:
        loop.close()
