"""``deft serve`` as a real process on 127.0.0.1, driven by the official ``openai`` client.

Two servers start once for the module, side by side: ``main`` (continuous batching, prefix
cache) and ``tight`` (one running request, one waiting, an API key, no prefix cache: the
429/401/disconnect cases, where pages in use must return to exactly 0). Results are
compared with the library on the same SmolLM2 in this process.
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
from collections.abc import Iterator

import pytest

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")

from deft.engine import (  # noqa: E402
    SamplingParams,
    TopKShape,
    TreeEngine,
    beam_search,
    generate,
    sample,
    speculative_generate,
)

MODEL = "SmolLM2-135M-Instruct"
KEY = "sesame"
STARTUP_S = 180


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    def __init__(self, *flags: str) -> None:
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "deft.cli", "serve", "--port", str(self.port), *flags],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)

    def wait(self) -> None:
        deadline = time.monotonic() + STARTUP_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                pytest.fail(f"deft serve exited with {self.proc.returncode}: {self.proc.stderr.read()}")
            try:
                if httpx.get(self.url + "/health", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                time.sleep(0.3)
        pytest.fail(f"deft serve did not answer /health within {STARTUP_S} s")

    def client(self, **kw) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url + "/v1", api_key=kw.pop("api_key", "none"), max_retries=0,
                             timeout=120, **kw)

    def metric(self, name: str) -> float:
        text = httpx.get(self.url + "/metrics", timeout=10).text
        m = re.search(rf"^{name} (\S+)$", text, re.M)
        assert m, f"{name} not in /metrics"
        return float(m.group(1))

    def until(self, name: str, value: float, timeout: float = 20.0) -> None:
        deadline = time.monotonic() + timeout
        while self.metric(name) != value:
            assert time.monotonic() < deadline, f"{name} stayed {self.metric(name)}, expected {value}"
            time.sleep(0.05)

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode


def running(started: list[Server]) -> Iterator[list[Server]]:
    """``started`` once each answers ``/health``; every one stopped afterwards (a fixture's
    body: ``yield from running([...])``)."""
    try:
        for s in started:
            s.wait()
        yield started
    finally:
        for s in started:
            s.stop()


@pytest.fixture(scope="module")
def servers(smol):
    from deft.model.loader import default_model_path

    try:
        default_model_path()
    except (FileNotFoundError, ValueError) as exc:
        pytest.skip(str(exc))
    yield from running([Server("--max-running", "8", "--max-queue", "64", "--num-pages", "512"),
                        Server("--max-running", "1", "--max-queue", "1", "--num-pages", "64",
                               "--api-key", KEY, "--no-prefix-cache")])


@pytest.fixture(scope="module")
def main_server(servers):
    return servers[0]


@pytest.fixture(scope="module")
def tight(servers):
    return servers[1]


@pytest.fixture(scope="module")
def engine(smol):
    return TreeEngine(*smol, num_pages=256)


def test_models_health_and_greedy_equal_to_the_library(main_server, engine, smol):
    _, tok = smol
    assert httpx.get(main_server.url + "/health").json() == {"status": "ok"}
    client = main_server.client()
    assert [m.id for m in client.models.list().data] == [MODEL]
    params = SamplingParams(max_new_tokens=8)
    out = client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=8,
                                    temperature=0)
    (ref,) = generate(engine, ["The capital of France is"], params)
    assert out.choices[0].text == ref.text
    assert out.choices[0].finish_reason == ref.stats["finish_reason"] == "length"
    assert (out.usage.prompt_tokens, out.usage.completion_tokens) == (len(tok.encode("The capital of France is")), 8)
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Name a colour."}],
                                          max_tokens=8, temperature=0)
    (ref,) = generate(engine, [tok.apply_chat_template("Name a colour.")], params)
    assert chat.choices[0].message.content == ref.text and chat.choices[0].message.role == "assistant"


def test_n4_seeded_is_reproducible_shares_the_prompt_and_equals_the_library(main_server, engine):
    client = main_server.client()
    prompt = "Write a word about the sea:"
    computed = main_server.metric("deft_prompt_tokens_computed_total")
    runs = [client.completions.create(model=MODEL, prompt=prompt, max_tokens=6, n=4, temperature=0.9,
                                      seed=7, logprobs=2) for _ in range(2)]
    first = [c.text for c in runs[0].choices]
    assert [c.text for c in runs[1].choices] == first and len(set(first)) > 1
    # The four samples fork from one prompt node: each run computes the prompt once, not 4 times.
    assert main_server.metric("deft_prompt_tokens_computed_total") - computed == 2 * runs[0].usage.prompt_tokens
    ref = sample(engine, [prompt], 4, SamplingParams(temperature=0.9, seed=7, max_new_tokens=6))[0]
    assert first == [r.text for r in ref]
    lp = runs[0].choices[0].logprobs
    assert len(lp.token_logprobs) == len(ref[0].token_ids) and all(len(t) == 2 for t in lp.top_logprobs)
    assert sum(lp.token_logprobs) == pytest.approx(ref[0].score, abs=1e-3)


def test_streamed_deltas_equal_the_whole_answer(main_server):
    client = main_server.client()
    messages = [{"role": "user", "content": "Say something about trees."}]
    whole = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=12, temperature=0)
    chunks = list(client.chat.completions.create(model=MODEL, messages=messages, max_tokens=12,
                                                 temperature=0, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == whole.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason == whole.choices[0].finish_reason
    body = {"model": MODEL, "prompt": "One, two,", "max_tokens": 5, "temperature": 0, "stream": True}
    with httpx.stream("POST", main_server.url + "/v1/completions", json=body, timeout=60) as r:
        lines = [ln for ln in r.iter_lines() if ln]
    assert lines[-1] == "data: [DONE]"
    streamed = "".join(json.loads(ln[6:])["choices"][0]["text"] for ln in lines[:-1])
    body["stream"] = False
    assert streamed == httpx.post(main_server.url + "/v1/completions", json=body, timeout=60).json()["choices"][0]["text"]


def test_stop_strings_cut_the_text(main_server, engine):
    client = main_server.client()
    (ref,) = generate(engine, ["The capital of France is"], SamplingParams(max_new_tokens=8))
    stop = ref.text.strip()[2:4]
    out = client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=8,
                                    temperature=0, stop=[stop])
    assert out.choices[0].text == ref.text[:ref.text.index(stop)] and out.choices[0].finish_reason == "stop"


def test_beam_search_and_speculative_extras_equal_the_library(main_server, engine, smol):
    _, tok = smol
    client = main_server.client()
    prompt = "The capital of France is"
    out = client.completions.create(model=MODEL, prompt=prompt, max_tokens=4, n=2, best_of=3,
                                    extra_body={"use_beam_search": True, "length_penalty": 0.5})
    ref = beam_search(engine, [prompt], 3, 4, 0.5, num_return_sequences=2)[0]
    assert [c.text for c in out.choices] == [h.text for h in ref]
    chat = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Repeat: red green blue red green blue"}],
        max_tokens=6, temperature=0, extra_body={"speculative": {"drafter": "ngram", "tree": {"k": 2, "depth": 4}}})
    ids = tok.apply_chat_template("Repeat: red green blue red green blue")
    (spec,) = speculative_generate(engine, [ids], SamplingParams(max_new_tokens=6), tree=TopKShape(2, 4))
    (plain,) = generate(engine, [ids], SamplingParams(max_new_tokens=6))
    assert chat.choices[0].message.content == spec.text == plain.text
    stream = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Repeat: red green blue red green blue"}],
        max_tokens=6, temperature=0, stream=True, extra_body={"speculative": {"drafter": "ngram"}})
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == plain.text


def test_32_concurrent_clients_get_their_sequential_answers(main_server, engine):
    client = main_server.client()
    prompts = [f"Question {i}: what comes after {i}?" for i in range(32)]
    lengths = [1 + i % 3 for i in range(32)]
    answers: dict[int, str] = {}

    def ask(i: int) -> None:
        r = client.completions.create(model=MODEL, prompt=prompts[i], max_tokens=lengths[i], temperature=0)
        answers[i] = r.choices[0].text

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(32)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    expected = {}
    for k in set(lengths):
        idx = [i for i in range(32) if lengths[i] == k]
        for i, r in zip(idx, generate(engine, [prompts[i] for i in idx], SamplingParams(max_new_tokens=k))):
            expected[i] = r.text
    assert answers == expected
    main_server.until("deft_num_requests_running", 0)
    assert main_server.metric("deft_num_requests_waiting") == 0
    assert main_server.metric("deft_kv_pages_requests") == 0


def test_prefix_cache_hit_gives_the_same_greedy_answer(main_server, engine, smol):
    _, tok = smol
    client = main_server.client()
    system = "You are a careful assistant who answers in one short sentence about geography and rivers."
    hits, spared = main_server.metric("deft_prefix_cache_hits_total"), main_server.metric("deft_prefix_cache_hit_tokens_total")
    answers = []
    for q in ("Where is the Nile?", "Where is the Danube?"):
        messages = [{"role": "system", "content": system}, {"role": "user", "content": q}]
        answers.append(client.chat.completions.create(model=MODEL, messages=messages, max_tokens=6,
                                                      temperature=0).choices[0].message.content)
    assert main_server.metric("deft_prefix_cache_hits_total") >= hits + 1
    assert main_server.metric("deft_prefix_cache_hit_tokens_total") - spared >= 16
    chats = [tok.apply_chat_template([{"role": "system", "content": system}, {"role": "user", "content": q}])
             for q in ("Where is the Nile?", "Where is the Danube?")]
    assert answers == [generate(engine, [c], SamplingParams(max_new_tokens=6))[0].text for c in chats]


@pytest.mark.parametrize("body, param", [
    ({"model": MODEL, "prompt": "x", "n": 0}, "n"),
    ({"model": MODEL, "prompt": "x", "max_tokens": 0}, "max_tokens"),
    ({"model": MODEL, "prompt": "x", "temperature": "hot"}, "temperature"),
    ({"model": MODEL, "prompt": [1] * 9000}, "prompt"),
    ({"model": MODEL, "prompt": "x", "presence_penalty": 0.5}, "presence_penalty"),
    ({"model": MODEL, "prompt": "x", "frequency_penalty": -1}, "frequency_penalty"),
    ({"model": MODEL, "prompt": "x", "echo": True}, "echo"),
    ({"model": MODEL, "prompt": "x", "speculative": {"drafter": "model"}}, "speculative.drafter"),
])
def test_bad_requests_are_400_with_openai_errors(main_server, body, param):
    r = httpx.post(main_server.url + "/v1/completions", json=body, timeout=30)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["type"] == "invalid_request_error" and err["message"]


def test_malformed_json_and_unknown_route(main_server):
    r = httpx.post(main_server.url + "/v1/chat/completions", content=b"{not json",
                   headers={"content-type": "application/json"}, timeout=30)
    assert r.status_code == 400 and set(r.json()["error"]) == {"message", "type", "param", "code"}
    r = httpx.get(main_server.url + "/v1/nothing", timeout=30)
    assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"


def test_api_key_is_required(tight):
    with pytest.raises(openai.AuthenticationError):
        tight.client(api_key="wrong").models.list()
    assert httpx.get(tight.url + "/v1/models").status_code == 401
    assert [m.id for m in tight.client(api_key=KEY).models.list().data] == [MODEL]


def test_full_queue_is_429_and_a_disconnect_frees_the_pages(tight):
    client = tight.client(api_key=KEY)
    body = {"model": MODEL, "prompt": "Tell a long story:", "max_tokens": 400, "temperature": 0, "stream": True}
    headers = {"authorization": f"Bearer {KEY}"}
    with httpx.stream("POST", tight.url + "/v1/completions", json=body, headers=headers, timeout=60) as r:
        lines = r.iter_lines()
        assert next(ln for ln in lines if ln).startswith("data: ")  # running, streaming
        waiting = {}
        t = threading.Thread(target=lambda: waiting.setdefault("r", client.completions.create(
            model=MODEL, prompt="Hi", max_tokens=2, temperature=0)))
        t.start()
        tight.until("deft_num_requests_waiting", 1)
        with pytest.raises(openai.RateLimitError) as err:
            client.completions.create(model=MODEL, prompt="Hi", max_tokens=2)
        assert err.value.body["code"] == "rate_limit_exceeded"
        assert tight.metric("deft_kv_pages_in_use") > 0
    # The streaming client went away: its request is cancelled, the waiting one runs.
    t.join(60)
    assert waiting["r"].choices[0].finish_reason == "length"
    tight.until("deft_num_requests_running", 0)
    tight.until("deft_kv_pages_in_use", 0)
    assert tight.metric('deft_requests_total{outcome="cancelled"}') >= 1


def test_sigterm_shuts_down_with_exit_0(tight):
    assert tight.stop() == 0
