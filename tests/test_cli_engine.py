"""The generation commands (generate, sample, beam), the engine demo and their user errors.

Successful runs reuse one loaded SmolLM2 (``deft.cli.common.load`` is patched); the model-path
errors go through the real loader.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest
import torch

import deft.cli.common as cli_common
from deft.cli import main
from deft.cli.demo import engine_demo
from deft.engine import SamplingParams, TreeEngine, beam_search, generate

PROMPT = "The capital of France is"


@pytest.fixture
def loaded(smol, monkeypatch):
    monkeypatch.setattr(cli_common, "load", lambda args: smol)
    return smol


def run_json(capsys, argv):
    assert main(argv + ["--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_generate_json_matches_the_engine(loaded, capsys):
    model, tok = loaded
    out = run_json(capsys, ["generate", PROMPT, "Name a colour.", "--chat", "--max-new-tokens", "5"])
    engine = TreeEngine(model, tok, num_pages=64)
    ref = generate(engine, [tok.apply_chat_template(PROMPT), tok.apply_chat_template("Name a colour.")],
                   SamplingParams(max_new_tokens=5))
    assert [r["token_ids"] for r in out] == [r.token_ids for r in ref]
    assert [r["text"] for r in out] == [r.text for r in ref]
    assert [r["prompt"] for r in out] == [0, 1] and all(r["score"] < 0 for r in out)


def test_sample_and_beam_json(loaded, capsys):
    model, tok = loaded
    out = run_json(capsys, ["sample", PROMPT, "-n", "3", "--temperature", "0.8", "--seed", "1",
                            "--max-new-tokens", "4"])
    assert [(r["prompt"], r["sample"]) for r in out] == [(0, 0), (0, 1), (0, 2)]
    assert all(len(r["token_ids"]) <= 4 and isinstance(r["score"], float) for r in out)
    again = run_json(capsys, ["sample", PROMPT, "-n", "3", "--temperature", "0.8", "--seed", "1",
                              "--max-new-tokens", "4"])
    assert again == out
    out = run_json(capsys, ["beam", PROMPT, "-k", "3", "--num-return-sequences", "2",
                            "--max-new-tokens", "6", "--length-penalty", "0.5"])
    ref = beam_search(TreeEngine(model, tok, num_pages=64), PROMPT, 3, 6, 0.5, num_return_sequences=2)[0]
    assert [r["token_ids"] for r in out] == [h.token_ids for h in ref]
    assert [r["score"] for r in out] == pytest.approx([h.score for h in ref])


def test_text_output_and_speed_line(loaded, capsys):
    assert main(["generate", PROMPT, "Hello", "--max-new-tokens", "3"]) == 0
    cap = capsys.readouterr()
    assert cap.out.startswith("[prompt 1, score ") and "[prompt 2, score " in cap.out
    assert re.search(r"\[generate\] \d+ new tokens in [\d.]+ s \([\d.]+ tokens/s, \d+ forwards\)", cap.err)


@pytest.mark.parametrize("argv, message", [
    (["sample", PROMPT, "-n", "0"], "-n: expected an integer in [1, 256], got 0"),
    (["sample", PROMPT, "-n", "257"], "-n: expected an integer in [1, 256], got 257"),
    (["beam", PROMPT, "-k", "0"], "-k: expected an integer in [1, 64], got 0"),
    (["beam", PROMPT, "-k", "2", "--num-return-sequences", "3"],
     "--num-return-sequences: expected an integer in [1, 2], got 3"),
    (["beam", PROMPT, "-k", "2", "--length-penalty", str(2**64)], "--length-penalty: expected a number in [-32, 32]"),
    (["beam", PROMPT, "-k", "2", "--length-penalty", "nan"], "--length-penalty: expected a number in [-32, 32]"),
    (["generate", PROMPT, "--top-k", "5"], "--top-k: has no effect with --temperature 0"),
    (["generate", PROMPT, "--seed", "3"], "--seed: has no effect with --temperature 0"),
    (["sample", PROMPT, "-n", "2", "--temperature", "0"], "--temperature 0: the samples would all be"),
    (["generate", PROMPT, "--temperature", "1", "--top-p", "1.5"], "--top-p: expected a number in (0, 1]"),
    (["generate", PROMPT, "--temperature", "-1"], "--temperature: expected a finite number >= 0"),
    (["generate", PROMPT, "--max-new-tokens", "0"], "--max-new-tokens: expected an integer"),
    (["generate", PROMPT, "--temperature", "1", "--seed", str(2**64)],
     "--seed: expected an integer in [-9223372036854775808, 18446744073709551615]"),
    (["generate", "word " * 9000], "PROMPT 1: 9001 tokens, longer than the model's context of 8192"),
    (["generate", PROMPT, ""], "PROMPT 2: encodes to no tokens"),
    (["bench", "e2e", "--workload", "nope"], "--workload: expected one of"),
    (["bench", "e2e", "--reps", "0"], "--reps: expected an integer in [1, 100], got 0"),
    (["bench", "e2e", "--threads", "0"], "--threads: expected an integer in [1, 1024], got 0"),
])
def test_user_errors(loaded, capsys, argv, message):
    assert main(argv) == 2
    err = capsys.readouterr().err
    prog = " ".join(["deft", *argv[:2 if argv[0] == "bench" else 1]])  # the command, named
    assert err.count("\n") == 1 and err.startswith(f"{prog}: error: ") and message in err, err


def test_non_utf8_prompt_bytes_are_replaced(loaded, capsys):
    """``deft generate $'caf\\xe9 \\xff'``: Python keeps undecodable argv bytes as surrogate
    escapes; every command decodes them as U+FFFD instead of crashing in the tokenizer."""
    _, tok = loaded
    out = run_json(capsys, ["generate", "caf\udce9 \udcff", "--max-new-tokens", "2"])
    ref = generate(TreeEngine(*loaded, num_pages=64), [tok.encode("caf\ufffd \ufffd")],
                   SamplingParams(max_new_tokens=2))
    assert [r["token_ids"] for r in out] == [r.token_ids for r in ref]


def test_argument_errors_are_one_line(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["sample", PROMPT])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert err == "deft sample: error: the following arguments are required: -n (see deft sample --help)\n"


@pytest.mark.parametrize("argv,err", [
    (["sample", PROMPT, "-n", "2", "--max-tokens", "3"],
     "deft sample: error: unrecognized arguments: --max-tokens 3; did you mean "
     "--max-new-tokens? (see deft sample --help)\n"),
    (["bench", "attention", "--workload=x", "--devise", "cpu"],
     "deft bench attention: error: unrecognized arguments: --devise cpu; did you mean "
     "--device? (see deft bench attention --help)\n"),
    (["generate", PROMPT, "--zzz"],
     "deft generate: error: unrecognized arguments: --zzz (see deft generate --help)\n"),
])
def test_an_unknown_option_is_named_by_its_command_with_the_nearest_one(capsys, argv, err):
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    assert capsys.readouterr().err == err


def test_model_errors(tmp_path, capsys):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF" + b"\x03\x00\x00\x00" + b"\xff" * 40)
    not_gguf = tmp_path / "notes.gguf"
    not_gguf.write_text("hello")
    for argv, message in [
        (["generate", PROMPT, "--model", str(tmp_path / "none.gguf")], "no such model file"),
        (["sample", PROMPT, "-n", "2", "--model", str(bad)], str(bad)),
        (["beam", PROMPT, "-k", "2", "--model", str(not_gguf)], "not a GGUF file"),
    ]:
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and err.startswith(f"deft {argv[0]}: error: --model: ") \
            and message in err, err
    if not torch.cuda.is_available():
        assert main(["generate", PROMPT, "--device", "cuda"]) == 2
        assert "--device cuda: no CUDA device is available" in capsys.readouterr().err


def test_replay_command(loaded, capsys, tmp_path):
    from test_engine import write_trace

    path = tmp_path / "tiny.json"
    write_trace(path)
    out = run_json(capsys, ["replay", str(path), "--iterations", "6", "--tokens", "greedy"])
    assert (out["iterations"], out["decode_tokens"], out["prompt_tokens"]) == (6, 3 * 3 + 2 * 2 + 3, 40)
    assert out["kv_ratio"] > 1 and out["tokens_per_s"] > 0
    assert main(["replay", str(path)]) == 0
    assert "9 iterations, 40-token prompt, 5 thoughts" in capsys.readouterr().out
    malformed = tmp_path / "malformed.json"
    malformed.write_text(path.read_text().replace('"end": 9', '"end": null'))
    for argv, message in [([str(tmp_path / "none.json")], "TRACE: "), ([str(path), "--record", "1"], "record: "),
                          ([str(malformed)], "thought 4: end is not an integer: None"),
                          ([str(path), "--iterations", "0"], "--iterations: ")]:
        assert main(["replay", *argv]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and message in err, err


def test_engine_demo(smol):
    text = engine_demo(smol, new_tokens=4, replay_iterations=0)
    ratios = [float(x) for x in re.findall(r"\(([\d.]+)x less\)", text)]
    assert "Beam search, k=4" in text and "Parallel sampling, n=8" in text
    assert len(ratios) >= 2 and all(r > 1 for r in ratios)
    assert "Speculative decoding" in text
    assert re.search(r"[\d.]+ accepted draft tokens per step", text) and "same tokens: yes" in text


def test_demo_core_only(capsys):
    assert main(["demo", "--core"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("DeFT attention core demo") and "engine demo" not in out


# ------------------------------------------------ the K/V budget (--kv-memory)


@pytest.mark.parametrize("value, size", [("2GiB", 2 << 30), ("512MB", 512 * 10**6), ("1048576", 1 << 20),
                                         ("1.5 kib", 1536), ("3B", 3)])
def test_kv_memory_sizes(value, size):
    assert cli_common.byte_size(value) == size


@pytest.mark.parametrize("value", ["", "0", "2 GiBs", "-1", "1e9", "0.5B", "GiB"])
def test_kv_memory_bad_sizes_are_one_line(capsys, value):
    with pytest.raises(SystemExit) as exc:
        main(["generate", PROMPT, "--kv-memory", value])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and err.count("\n") == 1
    assert "argument --kv-memory: expected a size of at least one byte such as 2GiB, 512MB or 1048576" in err


def test_kv_memory_too_small(loaded, capsys):
    """A budget below one page, then one that cannot hold the prompt: one line each, exit 2."""
    assert main(["generate", PROMPT, "--kv-memory", "100KB"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--kv-memory: the K/V budget of 97.7 KiB (--kv-memory) holds no " \
        "16-token page of 720.0 KiB" in err, err
    assert main(["generate", "word " * 100, "--kv-memory", "2MiB"]) == 2  # 101 tokens: 7 pages
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("deft generate: error: KV cache is full: needed 7 free pages of "
                                                   "16 tokens, 2 free of 2 in a K/V budget of 2.0 MiB "
                                                   "(--kv-memory); raise --kv-memory"), err


def test_requests_that_do_not_fit_together_wait(loaded, capsys):
    """A budget of 4 pages admits one of three requests at a time (each wants 3 pages free:
    prompt, a token's page, a fork's copy): they run one after another, in more forwards,
    with the tokens of a run where all fit at once."""
    prompts = [PROMPT, "Name a colour.", "One, two, three,"]

    def forwards_and_tokens(*flags: str) -> tuple[int, list]:
        assert main(["generate", *prompts, "--max-new-tokens", "4", "--json", *flags]) == 0
        out, err = capsys.readouterr()
        return int(re.search(r"(\d+) forwards", err).group(1)), [r["token_ids"] for r in json.loads(out)]

    free_steps, free = forwards_and_tokens()
    tight_steps, tight = forwards_and_tokens("--kv-memory", "3MiB")  # 4 pages of 720 KiB
    assert tight == free and tight_steps >= 2 * free_steps, (free_steps, tight_steps)


CHILD = """
import resource, sys
from deft.cli import main
with open("/proc/self/status") as f:
    mapped = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmSize:"))
resource.setrlimit(resource.RLIMIT_AS, (mapped + (768 << 20), resource.getrlimit(resource.RLIMIT_AS)[1]))
sys.exit(main(sys.argv[1:]))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="RLIMIT_AS and /proc are Linux's")
def test_worst_case_pool_is_not_allocated_under_a_memory_limit(tmp_path):
    """``deft sample hi -n 256 --max-new-tokens 8192`` with 768 MiB of address space to spare:
    the worst case would be 262 GB of K/V (1 MiB pages); the pool takes a share of what is
    free, and the run succeeds or stops with one line, exit code 2."""
    from test_fuzz_loaders import write_tiny_gguf

    model = tmp_path / "wide.gguf"
    write_tiny_gguf(model, max_position_embeddings=8192, num_layers=8, num_heads=8, num_kv_heads=8, head_dim=128)
    argv = ["sample", "hi", "-n", "256", "--max-new-tokens", "8192", "--model", str(model), "--json"]
    done = subprocess.run([sys.executable, "-c", CHILD, *argv], capture_output=True, text=True, timeout=300)
    assert "Traceback" not in done.stderr and "MemoryError" not in done.stderr, done.stderr[-2000:]
    assert done.returncode in (0, 2), done.stderr[-2000:]
    if done.returncode == 2:
        err = [line for line in done.stderr.splitlines() if line.startswith("deft")]
        assert err == [done.stderr.strip().splitlines()[-1]] and err[0].startswith("deft sample: error: KV cache is full")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/status")
def test_pool_memory_is_not_touched_until_used():
    """A 1 GiB pool is not zero-filled: the process's resident memory barely grows."""
    from deft.cache import KVPool

    def resident() -> int:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))

    before = resident()
    pool = KVPool(1, 1 << 14, 16, 8, 64)  # K and V: 2 x 512 MiB of float32
    assert pool.k[0].numel() * 4 == 1 << 29 and resident() - before < 64 << 20


def test_serve_model_id_is_the_file_stem_or_the_directory_name(tmp_path):
    from deft.cli.serve import model_id

    hf = tmp_path / "SmolLM2-1.7B-Instruct"
    hf.mkdir()
    (tmp_path / "tiny.gguf").write_bytes(b"")
    assert model_id(f"{hf}/") == model_id(str(hf)) == "SmolLM2-1.7B-Instruct"
    assert model_id(str(tmp_path / "tiny.gguf")) == "tiny"
    assert model_id(None) == "SmolLM2-135M-Instruct"


def test_a_gguf_model_without_the_gguf_package_is_a_user_error():
    """Without the ``model`` extra's ``gguf``, the default GGUF model is one line naming the
    file and the package, exit code 2."""
    script = ("import sys; sys.modules['gguf'] = None; from deft.cli import main; "
              "sys.exit(main(['generate', 'hi', '--max-new-tokens', '1', '--device', 'cpu']))")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 2, done.stderr[-2000:]
    assert done.stderr.count("\n") == 1 and done.stderr.startswith("deft generate: error: --model: "), done.stderr
    assert ".gguf: reading GGUF files needs the gguf package" in done.stderr, done.stderr
