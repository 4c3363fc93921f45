"""Gemma 3 beyond the checks every family gets in tests/test_families.py (logits, greedy and
beam tokens, bf16 load, chat template): float64 logits equal to transformers', bf16 norms and
embeddings bit-equal to transformers', the older config keys read as transformers reads them,
the language model of a multimodal checkpoint, a GGUF file as llama.cpp writes it, the context
capped to the sliding window, the fused-ops flag never taking Gemma to the fused kernels, a
Gemma tokenizer, and the refusals (Gemma 2, soft-capping, ...)."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from deft.engine import SamplingParams, TreeEngine, generate
from deft.model import LlamaConfig, load_model
from deft.model.gemma import gemma3_config, gemma3_gguf_config, gemma3_multimodal_config
from deft.model.llama import RMSNorm
from test_families import ATOL, FAMILIES, GGUF_NAMES, build_checkpoint, write_llama_cpp_gguf
from test_model import TINY_PROMPTS, assert_logits, forest_logits, reference_logits, write_tokenizer

gguf = pytest.importorskip("gguf")  # the ``model`` extra's

transformers = pytest.importorskip("transformers")

WINDOW = FAMILIES["gemma3_text"][2]["sliding_window"]


@pytest.fixture(scope="module")
def gemma(tmp_path_factory):
    folder = tmp_path_factory.mktemp("gemma3")
    return folder, build_checkpoint(folder, "gemma3_text")


def saved_config(folder) -> dict:
    return json.loads((folder / "config.json").read_text())


def build_multimodal(folder, text_ref):
    """A ``Gemma3ForConditionalGeneration`` whose language model holds ``text_ref``'s weights
    (a ``Gemma3ForCausalLM``), beside a tiny random SigLIP tower, saved by transformers."""
    vision = transformers.SiglipVisionConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                             num_attention_heads=2, image_size=28, patch_size=14)
    config = transformers.Gemma3Config(text_config=text_ref.config, vision_config=vision, mm_tokens_per_image=4,
                                       boi_token_index=260, eoi_token_index=261, image_token_index=262)
    model = transformers.Gemma3ForConditionalGeneration(config).eval()
    model.model.language_model.load_state_dict(text_ref.model.state_dict())
    model.save_pretrained(folder)
    write_tokenizer(folder)
    return model


def test_float64_logits_equal_transformers(gemma):
    """Float64 leaves only the roundings each side makes on purpose: the embedding scale
    (sqrt(48), exact in float64 as transformers' float64 model has it) and the norms'
    float32 arithmetic."""
    folder, _ = gemma
    model, _ = load_model(folder, dtype="float64")
    ref = transformers.Gemma3ForCausalLM.from_pretrained(folder, dtype=torch.float64).eval()
    for ids, got in zip(TINY_PROMPTS, forest_logits(model, TINY_PROMPTS)):
        assert_logits(got, reference_logits(ref, ids), 1e-10, f"float64, {len(ids)} tokens")


def test_bfloat16_norms_and_embeddings_round_as_transformers(gemma):
    folder, _ = gemma
    model, _ = load_model(folder, dtype="bfloat16")
    ref = transformers.Gemma3ForCausalLM.from_pretrained(folder, dtype=torch.bfloat16).eval()
    ids = torch.tensor(TINY_PROMPTS[2])
    with torch.no_grad():
        want = ref.model.embed_tokens(ids[None])[0]
        assert torch.equal(model.embed_tokens(ids), want)  # sqrt(48) as bf16 6.9375, not 6.928
        assert not torch.equal(model.embed(ids) * 48 ** 0.5, want)
        x = torch.randn(64, 48).bfloat16()
        ours, theirs = model.layers[1], ref.model.layers[1]
        pairs = [(ours.attn_norm, theirs.input_layernorm), (ours.post_attn_norm, theirs.post_attention_layernorm),
                 (ours.mlp_norm, theirs.pre_feedforward_layernorm),
                 (ours.post_mlp_norm, theirs.post_feedforward_layernorm), (model.norm, ref.model.norm)]
        for mine, hf in pairs:
            assert torch.equal(mine(x), hf(x))
        heads = torch.randn(64, 4, 24).bfloat16()
        assert torch.equal(ours.q_norm(heads), theirs.self_attn.q_norm(heads))
        # Llama's rounding (normalised x rounded, then scaled by the weight) differs.
        llama = RMSNorm(48, ours.attn_norm.eps)
        llama.weight.data = (1 + ours.attn_norm.weight.float()).bfloat16()
        assert not torch.equal(llama(x), ours.attn_norm(x))


def test_older_config_keys_read_as_transformers_reads_them(gemma):
    folder, _ = gemma
    raw = {k: v for k, v in saved_config(folder).items() if k not in ("layer_types", "rope_parameters")}
    old = {**raw, "num_hidden_layers": 6, "sliding_window_pattern": 3, "rope_theta": 5e5,
           "rope_local_base_freq": 1234.0, "rope_scaling": {"rope_type": "linear", "factor": 4.0}}
    ours = gemma3_config(old)
    assert ours == gemma3_config(transformers.Gemma3TextConfig(**old).to_dict())
    assert ours.local_rope_layers == (0, 1, 3, 4)
    assert (ours.rope_theta, ours.rope_scaling.factor, ours.local_rope_theta) == (5e5, 4.0, 1234.0)
    assert ours.local_rope_scaling is None


def test_a_multimodal_text_config_takes_transformers_defaults():
    """Google's multimodal checkpoints state only what differs from Gemma3TextConfig's defaults
    (here gemma-3-4b's text_config)."""
    text = {"hidden_size": 2560, "intermediate_size": 10240, "model_type": "gemma3_text",
            "num_hidden_layers": 34, "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
            "sliding_window": 1024}
    ours = gemma3_multimodal_config({"model_type": "gemma3", "text_config": text})
    hf = transformers.Gemma3Config(text_config=text).text_config.to_dict()
    assert ours == gemma3_config(hf)
    assert (ours.vocab_size, ours.num_heads, ours.head_dim) == (262_208, 8, 256)
    assert ours.max_position_embeddings == 1024
    assert ours.local_rope_layers == tuple(i for i in range(34) if (i + 1) % 6)


def test_gemma3_config_flags(gemma):
    folder, _ = gemma
    c = gemma3_config(saved_config(folder))
    assert (c.norm_plus_one, c.sandwich_norms, c.qk_norm, c.hidden_act) == (True, True, True, "gelu_pytorch_tanh")
    assert (c.embed_scale, c.sm_scale, c.local_rope_layers) == (48 ** 0.5, 20 ** -0.5, (0, 2))
    assert not c.fusable and LlamaConfig(8, 8, 8, 1, 1, 1, query_pre_attn_scalar=4.0).fusable
    # Only a model with sliding layers is capped to the window.
    full = gemma3_config({**saved_config(folder), "layer_types": ["full_attention"] * 4})
    assert (full.max_position_embeddings, full.local_rope_layers) == (256, ())


def test_the_language_model_of_a_multimodal_checkpoint(gemma, tmp_path):
    folder, text_ref = gemma
    mm = build_multimodal(tmp_path, text_ref)
    model, _ = load_model(tmp_path)
    assert model.config == load_model(folder)[0].config
    for ids, got in zip(TINY_PROMPTS, forest_logits(model, TINY_PROMPTS)):
        assert_logits(got, reference_logits(mm, ids), ATOL, f"multimodal, {len(ids)} tokens")
    # Newer files name the language model model.language_model.*: the same weights load.
    path = tmp_path / "model.safetensors"
    save_file({n.replace("language_model.model.", "model.language_model."): t
               for n, t in load_file(path).items()}, path)
    renamed, _ = load_model(tmp_path)
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), renamed.state_dict().values()))


# llama.cpp's names of a Gemma 3 block's norms (the others are Llama's).
GGUF_BLOCK = {**GGUF_NAMES, "post_attention_layernorm": "post_attention_norm",
              "pre_feedforward_layernorm": "ffn_norm", "post_feedforward_layernorm": "post_ffw_norm"}


def write_gemma3_gguf(path, ref) -> None:
    """``ref``'s weights as llama.cpp's converter writes a Gemma 3 GGUF: ``1 + w`` for every
    norm weight, no query_pre_attn_scalar or layer pattern."""
    rope = ref.config.rope_parameters["full_attention"]
    write_llama_cpp_gguf(path, "gemma3", ref, GGUF_BLOCK, norm_offset=1.0, rope_freq_base=rope["rope_theta"],
                         rope_scaling_type=gguf.RopeScalingType.LINEAR, rope_scaling_factor=rope["factor"],
                         sliding_window=ref.config.sliding_window)


def test_a_gguf_file_matches_transformers(tmp_path):
    """llama.cpp's Gemma 3: every 6th layer full, the softmax scale of head_dim."""
    ref = build_checkpoint(tmp_path / "hf", "gemma3_text", seed=1, num_hidden_layers=6, layer_types=None,
                           query_pre_attn_scalar=24)
    assert ref.config.layer_types[4:] == ["sliding_attention", "full_attention"]
    path = tmp_path / "gemma3.gguf"
    write_gemma3_gguf(path, ref)
    model, _ = load_model(path)
    # The same config as the directory's (GGUF stores eps as a float32).
    assert dataclasses.replace(model.config, rms_norm_eps=1e-6) == load_model(tmp_path / "hf")[0].config
    for ids, got in zip(TINY_PROMPTS, forest_logits(model, TINY_PROMPTS)):
        assert_logits(got, reference_logits(ref, ids), ATOL, f"GGUF, {len(ids)} tokens")


def test_gguf_config_follows_llama_cpp():
    base = LlamaConfig(vocab_size=8, hidden_size=5376, intermediate_size=8, num_layers=62, num_heads=32,
                       num_kv_heads=16, head_dim=128, max_position_embeddings=131072)
    meta = {"general.architecture": "gemma3", "gemma3.attention.sliding_window": 1024}
    c = gemma3_gguf_config(meta, base)  # the 27B model: 5376 / 32 = 168, not head_dim
    assert (c.query_pre_attn_scalar, c.max_position_embeddings, len(c.local_rope_layers)) == (168, 1024, 52)
    c = gemma3_gguf_config({"general.architecture": "gemma3"}, dataclasses.replace(base, num_layers=26))
    assert (c.query_pre_attn_scalar, c.max_position_embeddings, c.local_rope_layers) == (128, 131072, ())
    with pytest.raises(ValueError, match="gemma3.final_logit_softcapping: expected none"):
        gemma3_gguf_config({**meta, "gemma3.final_logit_softcapping": 30.0}, base)


def test_the_models_softmax_scale_is_the_attentions(gemma):
    folder, _ = gemma
    model, tok = load_model(folder)
    assert model.attention(backend="torch").sm_scale == 20 ** -0.5
    engine = TreeEngine(model, tok, num_pages=8, page_size=16, backend="torch")
    assert engine.runner.attn.sm_scale == 20 ** -0.5


def test_the_fused_ops_flag_keeps_the_plain_ops(gemma):
    """Gemma's norms and GeGLU are not in the fused kernels: asked for them, the model still
    computes transformers' logits."""
    folder, ref = gemma
    model, _ = load_model(folder)
    model.fused_ops = True
    (got,) = forest_logits(model, TINY_PROMPTS[1:2])
    assert_logits(got, reference_logits(ref, TINY_PROMPTS[1]), ATOL, "fused_ops=True")


def test_the_context_is_capped_to_the_sliding_window(gemma):
    folder, _ = gemma
    model, tok = load_model(folder)
    assert model.config.max_position_embeddings == WINDOW
    engine = TreeEngine(model, tok, num_pages=32, page_size=16, backend="torch")
    with pytest.raises(ValueError, match=f"the prompt has {WINDOW + 1} tokens, more than the "
                                         f"model's context of {WINDOW} \\(its sliding window: attention "
                                         "is exact only within it\\)"):
        engine.add_prompt([5] * (WINDOW + 1))
    prompt = [5 + i % 200 for i in range(WINDOW - 4)]
    (got,) = generate(engine, [prompt], SamplingParams(max_new_tokens=20, stop_token_ids=frozenset()))
    assert len(prompt) + len(got.token_ids) == WINDOW + 1  # the last token is drawn, never fed
    assert got.stats["finish_reason"] == "length"


def test_cli_generates_and_refuses_a_prompt_beyond_the_window(gemma, capsys):
    from deft.cli import main

    folder, _ = gemma
    assert main(["generate", "hello", "--model", str(folder), "--max-new-tokens", "3", "--json"]) == 0
    assert main(["generate", "x" * (WINDOW + 1), "--model", str(folder)]) == 2
    err = capsys.readouterr().err
    assert f"longer than the model's context of {WINDOW} (its sliding window" in err
    assert "loaded in" in err and f"s, context {WINDOW} (its sliding window)" in err


def test_a_gemma_tokenizer_encodes_as_transformers(tmp_path):
    """A tokenizer saved by transformers' GemmaTokenizer (SentencePiece-style BPE with byte
    fallback, ``<bos>`` added by its post-processor) and Gemma's chat template, which writes
    ``<bos>`` itself: the same ids and text as transformers, and Gemma's stop tokens."""
    from test_families import TEMPLATES

    build_checkpoint(tmp_path, "gemma3_text", bos_token_id=2, eos_token_id=[1, 6], pad_token_id=0)
    specials = ["<pad>", "<eos>", "<bos>", "<unk>", "<mask>", "<start_of_turn>", "<end_of_turn>"]
    pieces = ["▁", "h", "e", "l", "o", "w", "r", "d", "he", "ll", "▁w", "or"]
    vocab = {t: i for i, t in enumerate(specials + [f"<0x{b:02X}>" for b in range(256)] + pieces)}
    hf = transformers.GemmaTokenizer(vocab=vocab, merges=[("h", "e"), ("l", "l"), ("▁", "w"), ("o", "r")],
                                     chat_template=TEMPLATES["gemma"], add_bos_token=True)
    hf.add_special_tokens({"additional_special_tokens": specials[5:]})
    hf.save_pretrained(tmp_path)
    _, tok = load_model(tmp_path)
    ref = transformers.AutoTokenizer.from_pretrained(tmp_path)
    for text in ["hello world", "Ünïcödé  x\n", ""]:
        ids = tok.encode(text)
        assert ids[:1] == [2] and ids == ref.encode(text), text
        assert tok.decode(ids) == ref.decode(ids)
    chat = [{"role": "user", "content": "hello"}]
    want = ref.apply_chat_template(chat, add_generation_prompt=True, tokenize=True)["input_ids"]
    assert tok.apply_chat_template(chat) == want and want.count(2) == 1
    assert tok.eos_token_ids == {1, 6}  # <eos>, <end_of_turn>


@pytest.mark.parametrize("change, message", [
    ({"model_type": "gemma2"}, r"model_type: expected one of llama, .*gemma3_text, gemma3, got 'gemma2' "
                               r"\(Gemma 2: its attention-logit soft-capping cannot be exact"),
    ({"model_type": "gemma3", "text_config": {"model_type": "gemma2"}},
     r"text_config: expected a gemma3_text configuration, got \{'model_type': 'gemma2'\}"),
    ({"attn_logit_softcapping": 50.0}, r"attn_logit_softcapping: expected null \(tanh soft-capping"),
    ({"final_logit_softcapping": 30.0}, r"final_logit_softcapping: expected null \(tanh soft-capping"),
    ({"use_bidirectional_attention": True}, r"use_bidirectional_attention: expected false"),
    ({"sliding_window": None}, r"sliding_window: expected a positive integer, got None"),
    ({"layer_types": ["full_attention"] * 3}, r"layer_types: expected 4 of sliding_attention, full_attention"),
    ({"rope_parameters": {"rope_type": "linear", "factor": 8.0}},
     r"rope_parameters: expected an object of sliding_attention, full_attention"),
    ({"hidden_activation": "gelu"}, r"hidden_act: expected one of silu, gelu_pytorch_tanh, got 'gelu'"),
])
def test_refusals_name_the_feature(tmp_path, change, message):
    build_checkpoint(tmp_path, "gemma3_text")
    (tmp_path / "config.json").write_text(json.dumps({**saved_config(tmp_path), **change}))
    with pytest.raises(ValueError, match="config.json: " + message):
        load_model(tmp_path)


def test_a_gemma2_gguf_is_refused_by_name(tmp_path):
    path = tmp_path / "g2.gguf"
    w = gguf.GGUFWriter(str(path), "gemma2")
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ValueError, match=r"general.architecture: expected one of llama, .*got 'gemma2' "
                                         r"\(Gemma 2: its attention-logit soft-capping"):
        load_model(path)


@pytest.mark.parametrize("change, message", [
    ({"local_rope_layers": (1, 0)}, r"local_rope_layers: expected increasing layer indices, got \(1, 0\)"),
    ({"local_rope_layers": (2,)}, r"local_rope_layers\[0\]: expected an integer in \[0, 1\], got 2"),
    ({"query_pre_attn_scalar": 0}, "query_pre_attn_scalar: expected a positive finite number, got 0"),
    ({"embed_scale": float("inf")}, "embed_scale: expected a positive finite number, got inf"),
    ({"norm_plus_one": 1}, "norm_plus_one: expected a bool, got 1"),
])
def test_config_checks_gemmas_fields(change, message):
    with pytest.raises(ValueError, match=message):
        LlamaConfig(8, 8, 8, 2, 1, 1, **change)
