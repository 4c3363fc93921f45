"""``deft bench serve`` end to end at a tiny size (the default model and ``random:tiny``): a
server subprocess, every kind of request, the library comparison, a sane result record, and
no server left behind (also on SIGTERM)."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys

import pytest

pytest.importorskip("openai")
pytest.importorskip("fastapi")

from benchmarks.report import load_record  # noqa: E402
import benchmarks.serve  # noqa: E402
from benchmarks.serve import KINDS, SYSTEM, request_mix  # noqa: E402

TIMEOUT_S = 150


def _bench(*flags: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "deft.cli", "bench", "serve", *flags],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def _server_pid(stderr: str) -> int:
    m = re.search(r"deft serve \(pid (\d+)\) starting", stderr)
    assert m, stderr
    return int(m.group(1))


def test_the_mix_is_deterministic_and_has_every_kind():
    mix = request_mix(8, 4)
    assert mix == request_mix(8, 4)
    assert {r.kind for r in mix[:4]} == set(KINDS) and sum(r.stream for r in mix) == 6


@pytest.fixture(scope="module")
def default_model():
    from deft.model.loader import default_model_path

    try:
        default_model_path()
    except (FileNotFoundError, ValueError) as exc:
        pytest.skip(str(exc))


def test_on_cuda_the_default_model_is_random_llama_3_8b(monkeypatch):
    seen = []

    class Started(Exception):
        pass

    def server(flags, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
        seen.append(flags)
        raise Started

    monkeypatch.setattr(benchmarks.serve, "ServerProcess", server)
    for device in ("cuda", "cpu"):
        with pytest.raises(Started):
            benchmarks.serve.serve_table(device=device)
    assert seen == [["--model", "random:llama-3-8b", "--device", "cuda", "--dtype", "auto",
                     "--kv-dtype", "auto"],
                    ["--device", "cpu", "--dtype", "auto", "--kv-dtype", "auto"]]


@pytest.mark.parametrize("model", [None, "random:tiny"])
def test_bench_serve_end_to_end(tmp_path, model, request):
    if model is None:
        request.getfixturevalue("default_model")
    path = tmp_path / "serve.json"
    proc = _bench("--concurrency", "1", "2", "--requests", "4", "--max-tokens", "4", "--num-pages", "256",
                  "--threads", "1", "--json", str(path), *(["--model", model] if model else []))
    try:
        out, err = proc.communicate(timeout=TIMEOUT_S)
    finally:
        proc.kill()
    assert proc.returncode == 0, err
    assert _gone(_server_pid(err)) and "stopped (0)" in err
    assert [line.split("|")[1].strip() for line in out.strip().splitlines()[-2:]] == [
        "library, one by one", "library, one batch"]
    rec = load_record(path)
    assert rec["requests"] == 4 and rec["max_tokens"] == 4 and rec["threads"] == 1
    assert rec["model"] == (model or "SmolLM2-135M-Instruct") and f"deft serve with {rec['model']} on cpu" in out
    if model is not None:  # byte-level tokenizer: a token per byte
        assert rec["mix"].startswith(f"chat: one {len(SYSTEM.encode())}-token system prompt")
    server, (library, batch) = rec["rows"][:-2], rec["rows"][-2:]
    assert [r["concurrency"] for r in server] == [1, 2]
    for row in rec["rows"]:
        assert row["completed"] == row["requests"] == 4
        # greedy 4 + sampled up to 4 + n=4 up to 16 + beam up to 4; at least one token each
        assert 7 <= row["completion tokens"] <= 28 and row["tok/s"] > 0 and row["wall s"] > 0
        assert row["prompt tokens"] > 4 * 200  # the shared system prompt
    for row in server:
        assert 0 < row["TTFT p50 ms"] <= row["TTFT p99 ms"] and 0 < row["ITL p50 ms"] <= row["ITL p99 ms"]
        assert row["prefix hit rate"] == 1.0  # the warm-up request cached the system prompt
        assert 0 < row["prompt computed %"] < 50
        assert row["x library"] == pytest.approx(row["tok/s"] / library["tok/s"])
        assert row["x batch"] == pytest.approx(row["tok/s"] / batch["tok/s"])
    assert library["TTFT p50 ms"] is None and library["x library"] == 1.0 and batch["x batch"] == 1.0
    assert batch["concurrency"] == 2  # the most concurrent level
    json.dumps(rec)


@pytest.mark.parametrize("when", ["warm-up request",  # the server is up; the first request goes out
                                  "concurrency 1: 2/8 requests"])  # inside a level's replay
def test_sigterm_stops_the_server(default_model, when):
    proc = _bench("--concurrency", "1", "--requests", "8", "--max-tokens", "8", "--num-pages", "256",
                  "--threads", "1")
    lines = []
    try:
        for line in proc.stderr:
            lines.append(line)
            if when in line:
                break
        proc.send_signal(signal.SIGTERM)
        rest = proc.communicate(timeout=60)[1]
    finally:
        proc.kill()
    err = "".join(lines) + rest
    assert proc.returncode == 128 + signal.SIGTERM, err
    assert _gone(_server_pid(err)) and "stopped (0)" in err
