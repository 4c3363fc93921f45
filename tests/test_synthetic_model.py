"""Random-weight models (``--model random:...``): the spec, the byte-level tokenizer, the
seeded weights, and ``deft serve`` on one as a real process driven by the ``openai`` client."""

from __future__ import annotations

import pytest
import torch

from deft.cli import main
from deft.cli.serve import model_id
from deft.engine import SamplingParams, TreeEngine, generate
from deft.model import load_random
from deft.model.synthetic import SHAPES, RandomSpec, _byte_symbols, byte_tokenizer, parse_spec, random_model


@pytest.mark.parametrize("spec, name, layers", [
    ("random:tiny", "tiny", 2),
    ("random:llama-3-8b", "llama-3-8b", 32),
    ("random:llama-3-8b:layers=4", "llama-3-8b", 4),
    ("random:tiny:layers=1024", "tiny", 1024),
])
def test_good_specs(spec, name, layers):
    parsed = parse_spec(spec)
    assert parsed.name == name and parsed.config.num_layers == layers and str(parsed) == spec
    assert model_id(spec) == spec


def test_llama_3_8b_shapes():
    c = parse_spec("random:llama-3-8b").config
    assert (c.vocab_size, c.hidden_size, c.intermediate_size, c.num_heads, c.num_kv_heads, c.head_dim,
            c.rope_theta) == (128256, 4096, 14336, 32, 8, 128, 500000.0)
    assert parse_spec("random:llama-3-8b:layers=4").config == RandomSpec("llama-3-8b", 4).config


def test_qwen3_8b_shapes():
    c = parse_spec("random:qwen3-8b").config
    assert (c.vocab_size, c.hidden_size, c.intermediate_size, c.num_layers, c.num_heads,
            c.num_kv_heads, c.head_dim, c.rope_theta, c.qk_norm) == (
        151936, 4096, 12288, 36, 32, 8, 128, 1000000.0, True)


@pytest.mark.parametrize("spec, message", [
    ("random:", "expected random:NAME or random:NAME:layers=N (NAME one of llama-3-8b, qwen3-8b, tiny), "
                "got 'random:'"),
    ("random:Tiny", "got 'random:Tiny'"),
    ("random:tiny:layers=", "got 'random:tiny:layers='"),
    ("random:tiny:layers=-1", "got 'random:tiny:layers=-1'"),
    ("random:tiny:heads=2", "got 'random:tiny:heads=2'"),
    ("random:gpt-2", "name: expected one of llama-3-8b, qwen3-8b, tiny, got 'gpt-2'"),
    ("random:tiny:layers=0", "layers: expected an integer in [1, 1024], got 0"),
    ("random:tiny:layers=1025", "layers: expected an integer in [1, 1024], got 1025"),
])
def test_bad_specs_say_what_is_accepted(spec, message):
    with pytest.raises(ValueError) as info:
        parse_spec(spec)
    assert message in str(info.value)


def test_a_bad_spec_is_one_line_naming_the_flag(capsys):
    assert main(["generate", "hi", "--model", "random:gpt-2"]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        "deft generate: error: --model: name: expected one of llama-3-8b, qwen3-8b, tiny, got 'gpt-2'"]


def test_byte_symbols_are_the_byte_level_alphabet():
    from tokenizers import pre_tokenizers

    symbols = _byte_symbols()
    assert len(set(symbols)) == 256 and set(symbols) == set(pre_tokenizers.ByteLevel.alphabet())


@pytest.mark.parametrize("text", ["", "plain ASCII, with  two spaces\nand a newline",
                                  "Héllo wörld ✓ 😀", "\x00\x7f tabs\t", " t300"])
def test_tokenizer_round_trip_is_utf8_bytes(text):
    tok = byte_tokenizer(2048)
    assert tok.encode(text) == list(text.encode()) and tok.decode(tok.encode(text)) == text


def test_chatml_markers_are_single_tokens():
    tok = byte_tokenizer(2048)
    assert tok.encode("<|im_start|>a<|im_end|>") == [256, ord("a"), 257]
    assert tok.decode([256, ord("a"), 257]) == "<|im_start|>a<|im_end|>"


def test_tokenizer_ids_and_chat_template():
    tok = byte_tokenizer(128256)
    assert tok.vocab_size == 128256 and tok.eos_token_ids == {257}
    assert tok.decode([300, 128255, 65]) == " t300 t128255A"
    assert tok.decode([256, 72, 257], skip_special_tokens=True) == "H"
    system = {"role": "system", "content": "Answer in one sentence."}
    chats = [tok.apply_chat_template([system, {"role": "user", "content": q}]) for q in ("Why?", "How?")]
    head = tok.encode("<|im_start|>system\nAnswer in one sentence.<|im_end|>\n<|im_start|>user\n")
    assert all(c[:len(head)] == head for c in chats) and chats[0][len(head)] != chats[1][len(head)]
    assert tok.decode(chats[0]).endswith("Why?<|im_end|>\n<|im_start|>assistant\n")
    with pytest.raises(ValueError, match="vocab_size: expected at least 258"):
        byte_tokenizer(257)


def test_weights_are_seeded_and_leave_the_global_generator_alone():
    config = SHAPES["tiny"]
    torch.manual_seed(123)
    expected_next = torch.rand(3)
    torch.manual_seed(123)
    a, b = random_model(config), random_model(config)
    assert torch.equal(torch.rand(3), expected_next)  # the caller's random stream is untouched
    assert a.dtype == torch.float32 and not any(p.requires_grad for p in a.parameters())
    for (name, p), q in zip(a.state_dict().items(), b.state_dict().values()):
        assert torch.equal(p, q), name
    other = random_model(config, seed=1)
    assert not torch.equal(other.embed.weight, a.embed.weight)


def test_serve_answers_chat_and_completion_as_the_library_does():
    openai = pytest.importorskip("openai")
    pytest.importorskip("fastapi")
    from benchmarks.serve import ServerProcess

    model, tok = load_random("random:tiny")
    engine = TreeEngine(model, tok, num_pages=64)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi?"}]
    expected_chat = generate(engine, [tok.apply_chat_template(messages)], SamplingParams(max_new_tokens=6))[0]
    expected_text = generate(engine, ["Once upon"], SamplingParams(max_new_tokens=6))[0]
    with ServerProcess(["--model", "random:tiny", "--num-pages", "64"], startup_s=60, threads=1) as server:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=30)
        assert [m.id for m in client.models.list().data] == ["random:tiny"]
        chat = client.chat.completions.create(model="random:tiny", messages=messages, max_tokens=6,
                                              temperature=0)
        text = client.completions.create(model="random:tiny", prompt="Once upon", max_tokens=6, temperature=0)
    assert chat.choices[0].message.content == expected_chat.text
    assert chat.usage.completion_tokens == len(expected_chat.token_ids) > 0
    assert chat.usage.prompt_tokens == len(tok.apply_chat_template(messages))
    assert text.choices[0].text == expected_text.text and text.usage.prompt_tokens == len(b"Once upon")
