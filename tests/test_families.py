"""Each registered family against ``transformers`` on a tiny random checkpoint built in the test:
logits of a forest of prompts, greedy and beam-search tokens through the engine, GGUF files
where llama.cpp has the architecture (and their tensor-parallel shards), chat templates; and
the errors users see. Phi-3 also with LongRoPE (``phi3_longrope``), within its original context.

Tolerance: float32 logits within ``ATOL`` (the torch backend's tiled attention sums in another
order than transformers' dense attention; measured ~1e-6 on these models).
"""

from __future__ import annotations

import json
import math
import re

import numpy as np
import pytest
import torch

from deft.engine import SamplingParams, TreeEngine, beam_search, generate
from deft.model import LlamaConfig, RopeScaling, load_model
from deft.model.loader import resolve_dtype
from deft.model.phi3 import phi3_config
from deft.model.rope import rope_table
from test_model import (TINY_PROMPTS, add_tiny_tokenizer, assert_logits, forest_logits, gguf,
                        needs_gguf, reference_logits, tiny_vocab, write_tokenizer)
from test_tensor_parallel import ThreadRanks

transformers = pytest.importorskip("transformers")

ATOL = 1e-4
EOS = [0, 2]  # <|endoftext|> and <|im_end|> of the tiny vocabulary
SHAPE = dict(vocab_size=len(tiny_vocab()), hidden_size=64, intermediate_size=96, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
             rms_norm_eps=1e-6, tie_word_embeddings=False, bos_token_id=0, eos_token_id=2,
             pad_token_id=0)


def longrope(head_dim: int, original: int = 64) -> dict:
    """Phi3Config keys of LongRoPE (the 128k Phi-3 and Phi-3.5) over :data:`SHAPE`'s context of
    256: a factor per rotated pair within the ``original`` context and past it; cos/sin are
    scaled by sqrt(1 + ln(256 / original) / ln(original)); the context is capped at ``original``."""
    half = head_dim // 2
    return dict(original_max_position_embeddings=original, rope_parameters={
        "rope_type": "longrope", "rope_theta": 10000.0, "short_factor": [1.0 + 2 * i / half for i in range(half)],
        "long_factor": [2.0 + i for i in range(half)]})


# (transformers config class, model class, extra config): each family's distinguishing features.
FAMILIES = {
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", dict(rope_theta=1e6, use_sliding_window=False,
                                                       sliding_window=32)),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(head_dim=24, tie_word_embeddings=True)),
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(head_dim=24, sliding_window=None)),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", dict(original_max_position_embeddings=256)),
    "phi3_longrope": ("Phi3Config", "Phi3ForCausalLM", longrope(16)),
    # SmolLM3: no RoPE in its second layer (every fourth in the real models)
    "smollm3": ("SmolLM3Config", "SmolLM3ForCausalLM", dict(no_rope_layers=[1, 0])),
    # Phi-4-mini's partial rotary (RoPE on 12 of each head's 16 dims) and LongRoPE over them
    "phi4_mini": ("Phi3Config", "Phi3ForCausalLM", dict(partial_rotary_factor=0.75, **longrope(12))),
    # Sliding and full layers (their own RoPE, linear scaling on the full ones), a softmax scale
    # not head_dim's, an embedding scale sqrt(48) that bf16 rounds; the window caps the context.
    "gemma3_text": ("Gemma3TextConfig", "Gemma3ForCausalLM", dict(
        num_hidden_layers=4, hidden_size=48, head_dim=24, query_pre_attn_scalar=20, sliding_window=128,
        layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                         "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6}},
        tie_word_embeddings=True)),
}


def build_checkpoint(folder, family: str, seed: int = 0, **changes):
    """A random ``family`` model of :data:`SHAPE` saved by transformers (float32), with the
    tiny tokenizer; returns the transformers model. Every weight is random (biases and norms
    included), large enough that greedy and beam choices are clear."""
    config_cls, model_cls, extra = FAMILIES[family]
    config = getattr(transformers, config_cls)(**{**SHAPE, **extra, **changes})
    torch.manual_seed(seed)
    model = getattr(transformers, model_cls)(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:  # a scale near 1: Gemma's norms scale by 1 + w
                p.copy_((0.0 if family.startswith("gemma") else 1.0) + 0.2 * torch.randn_like(p))
            elif "embed" in name:  # Gemma scales them by sqrt(hidden): the same residual scale
                p.normal_(0, config.hidden_size ** -0.5 if family == "gemma3_text" else 1.0)
            else:
                p.normal_(0, 1.5 / p.shape[-1] ** 0.5)
    model.save_pretrained(folder)
    write_tokenizer(folder)
    return model


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def checkpoint(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp(request.param)
    return request.param, folder, build_checkpoint(folder, request.param)


def test_logits_match_transformers(checkpoint):
    family, folder, ref = checkpoint
    model, _ = load_model(folder)
    assert model.dtype == torch.float32  # auto on the CPU
    c = model.config
    assert (c.qkv_bias, c.qk_norm) == (family == "qwen2", family in ("qwen3", "gemma3_text"))
    # Qwen2's unused sliding_window caps nothing; Gemma 3's sliding layers cap the context, and
    # LongRoPE's original context does.
    assert c.max_position_embeddings == {"gemma3_text": 128, "phi3_longrope": 64,
                                         "phi4_mini": 64}.get(family, 256)
    assert c.rope_dim == (12 if family == "phi4_mini" else c.head_dim)
    prompts = [p for p in TINY_PROMPTS if len(p) <= c.max_position_embeddings]
    for ids, got in zip(prompts, forest_logits(model, prompts)):
        assert_logits(got, reference_logits(ref, ids), ATOL, f"{family}, {len(ids)} tokens")


def test_greedy_and_beam_match_transformers(checkpoint):
    family, folder, ref = checkpoint
    engine = TreeEngine(*load_model(folder), num_pages=64, page_size=16, backend="torch")
    prompts, new = [TINY_PROMPTS[0], TINY_PROMPTS[1]], 8

    def hf(ids, **kwargs):
        return ref.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                            max_new_tokens=new, do_sample=False, eos_token_id=EOS, pad_token_id=2, **kwargs)

    for ids, got in zip(prompts, generate(engine, prompts, SamplingParams(max_new_tokens=new))):
        assert got.token_ids == hf(ids)[0, len(ids):].tolist(), family
    for ids, hyps in zip(prompts, beam_search(engine, prompts, 3, new, num_return_sequences=2)):
        out = hf(ids, num_beams=3, num_return_sequences=2, output_scores=True, return_dict_in_generate=True)
        for j, hyp in enumerate(hyps):
            seq = out.sequences[j, len(ids):].tolist()
            assert hyp.token_ids == seq[:len(hyp.token_ids)], (family, j)
            assert hyp.score == pytest.approx(float(out.sequences_scores[j]), abs=1e-3)


def test_phi3_heads_of_24_decode_alike_on_both_backends(tmp_path):
    """Phi-3's real heads are 96, not a power of two: the triton kernels pad their blocks
    (interpreted here; heads of 24 in blocks of 32), and greedy and beam tokens equal the
    torch backend's."""
    pytest.importorskip("triton")
    build_checkpoint(tmp_path, "phi3", hidden_size=96, head_dim=24)
    model, tok = load_model(tmp_path)
    assert model.config.head_dim == 24
    prompts, runs = [TINY_PROMPTS[0], TINY_PROMPTS[1]], []
    for backend in ("torch", "triton"):
        engine = TreeEngine(model, tok, num_pages=64, page_size=16, backend=backend)
        runs.append(([r.token_ids for r in generate(engine, prompts, SamplingParams(max_new_tokens=6))],
                     [h.token_ids for h in beam_search(engine, prompts[0], 3, 6, num_return_sequences=2)[0]]))
    assert runs[0] == runs[1]


# ---------------------------------------------------------------- GGUF (qwen2, qwen3, phi3)


GGUF_NAMES = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
              "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
              "self_attn.qkv_proj": "attn_qkv", "self_attn.o_proj": "attn_output",
              "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
              "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.gate_up_proj": "ffn_up",
              "mlp.down_proj": "ffn_down"}


def write_llama_cpp_gguf(path, arch: str, ref, names: dict[str, str] = GGUF_NAMES,
                         norm_offset: float = 0.0, extra_tensors=(), **metadata) -> None:
    """``ref``'s weights as llama.cpp's converter writes a GGUF of ``arch``: F32, q/k rows
    unpermuted, Phi-3's fused q/k/v and gate/up kept fused (its LongRoPE factors as tensors,
    the original context and attention factor as metadata), block tensors named by
    ``names``, ``norm_offset`` added to the norm weights. ``metadata`` replaces the
    ``add_<key>`` values (None: left out); ``extra_tensors`` are (name, array) pairs."""
    needs_gguf()
    c = ref.config
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    values = dict(block_count=c.num_hidden_layers, context_length=c.max_position_embeddings,
                  embedding_length=c.hidden_size, feed_forward_length=c.intermediate_size,
                  head_count=c.num_attention_heads, head_count_kv=c.num_key_value_heads,
                  key_length=head_dim, value_length=head_dim, rope_freq_base=c.rope_parameters.get("rope_theta"),
                  layer_norm_rms_eps=c.rms_norm_eps)
    if arch == "phi3":  # as Phi3MiniModel writes it: no key/value length, a window (0: none)
        rope, original = c.rope_parameters, c.original_max_position_embeddings
        rotary = int(head_dim * getattr(c, "partial_rotary_factor", 1.0))
        values.update(key_length=None, value_length=None, rope_dimension_count=rotary,
                      sliding_window=c.sliding_window or 0, rope_scaling_orig_ctx_len=original)
        if rope["rope_type"] == "longrope":
            scale = c.max_position_embeddings / original
            values["rope_scaling_attn_factors"] = math.sqrt(1 + math.log(scale) / math.log(original))
            extra_tensors = [(f"rope_factors_{k}.weight", np.array(rope[f"{k}_factor"], np.float32))
                             for k in ("long", "short")] + list(extra_tensors)
    w = gguf.GGUFWriter(str(path), arch)
    for key, value in {**values, **metadata}.items():
        if value is not None:
            getattr(w, f"add_{key}")(value)
    add_tiny_tokenizer(w, "qwen2")
    for name, t in ref.state_dict().items():
        if name == "lm_head.weight" and c.tie_word_embeddings:
            continue
        if name.startswith("model.layers."):
            _, _, layer, rest = name.split(".", 3)
            module, suffix = rest.rsplit(".", 1)
            out = f"blk.{layer}.{names[module]}.{suffix}"
        else:
            out = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
                   "lm_head.weight": "output.weight"}[name]
        data = t.numpy().astype(np.float32)
        w.add_tensor(out, data + np.float32(norm_offset) if name.endswith("norm.weight") else data)
    for name, a in extra_tensors:
        w.add_tensor(name, a)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.mark.parametrize("family", ["qwen2", "qwen3", "phi3", "phi3_longrope", "phi4_mini"])
def test_gguf_matches_transformers(family, tmp_path):
    ref = build_checkpoint(tmp_path / "hf", family, seed=1)
    path = tmp_path / f"{family}.gguf"
    write_llama_cpp_gguf(path, "phi3" if family == "phi4_mini" else family.split("_")[0], ref)
    model, tok = load_model(path)
    c = model.config
    assert (c.qkv_bias, c.qk_norm) == (family == "qwen2", family == "qwen3")
    assert c.max_position_embeddings == (64 if family in ("phi3_longrope", "phi4_mini") else 256)
    assert c.rope_dim == (12 if family == "phi4_mini" else c.head_dim)
    prompts = [p for p in TINY_PROMPTS if len(p) <= c.max_position_embeddings]
    for ids, got in zip(prompts, forest_logits(model, prompts)):
        assert_logits(got, reference_logits(ref, ids), ATOL, f"{family} GGUF, {len(ids)} tokens")
    engine = TreeEngine(model, tok, num_pages=64, page_size=16, backend="torch")
    prompts = TINY_PROMPTS[:2]
    for ids, got in zip(prompts, generate(engine, prompts, SamplingParams(max_new_tokens=8))):
        want = ref.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                            max_new_tokens=8, do_sample=False, eos_token_id=EOS, pad_token_id=2)
        assert got.token_ids == want[0, len(ids):].tolist(), family
    ref_tok = transformers.AutoTokenizer.from_pretrained(tmp_path, gguf_file=path.name)
    for text in ["hello world 12345", "Ünïcödé 2024 — it's\n\n  x"]:
        assert tok.encode(text) == ref_tok.encode(text), text


@pytest.mark.parametrize("family, metadata, positions", [
    ("phi3", dict(sliding_window=32), 32),  # within the window full attention is exact
    ("phi3", dict(sliding_window=None, context_length=4096), 2047),  # Phi-3-mini-4k converted before the key
    ("phi3", dict(sliding_window=None), 256),
    ("phi3_longrope", dict(sliding_window=32), 32),
    # LongRoPE: the original context (Phi-3-mini-128k's, converted before the window key)
    ("phi3_longrope", dict(sliding_window=None, context_length=131072, rope_scaling_orig_ctx_len=4096), 4096),
])
def test_phi3_gguf_context_capped_at_the_window_or_the_original_context(tmp_path, family, metadata, positions):
    ref = build_checkpoint(tmp_path / "hf", family)
    write_llama_cpp_gguf(tmp_path / "phi3.gguf", "phi3", ref, **metadata)
    assert load_model(tmp_path / "phi3.gguf")[0].config.max_position_embeddings == positions


@pytest.mark.parametrize("world", [2, 4])
def test_phi3_gguf_tensor_parallel_ranks_give_the_whole_models_logits(tmp_path, world):
    ref = build_checkpoint(tmp_path / "hf", "phi3")
    path = tmp_path / "phi3.gguf"
    write_llama_cpp_gguf(path, "phi3", ref)
    want = forest_logits(load_model(path)[0], TINY_PROMPTS)
    ranks = ThreadRanks(world)
    shards = [load_model(path, tp=ranks.rank(r))[0] for r in range(world)]
    assert [s.config.num_heads for s in shards] == [4 // world] * world
    got = ranks.run(lambda r: forest_logits(shards[r], TINY_PROMPTS))
    for r in range(world):
        for a, b in zip(got[r], want):
            torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def test_phi3_gguf_refusals_name_the_tensor_or_key(tmp_path):
    ref = build_checkpoint(tmp_path / "hf", "phi3")
    path = tmp_path / "phi3.gguf"
    write_llama_cpp_gguf(path, "phi3", ref, head_count_kv=4)
    with pytest.raises(ValueError, match=re.escape(str(path)) + r": tensor 'blk.0.attn_qkv.weight' has "
                                         r"shape \(128, 64\), expected \(192, 64\) from the metadata"):
        load_model(path)
    write_llama_cpp_gguf(path, "phi3", ref, extra_tensors=[("rope_factors_long.weight", np.ones(8, np.float32))])
    with pytest.raises(ValueError, match=re.escape(str(path)) + r": tensor 'rope_factors_short.weight': "
                                         r"missing \(LongRoPE's factors within the original context\)"):
        load_model(path)
    write_llama_cpp_gguf(path, "phi3", build_checkpoint(tmp_path / "hf", "phi3_longrope"),
                         rope_scaling_orig_ctx_len=None)
    with pytest.raises(ValueError, match=re.escape(str(path)) + ": phi3.rope.scaling.original_context_length: "
                                         "missing from the GGUF metadata"):
        load_model(path)


# ---------------------------------------------------------------- LongRoPE (phi3)


def _longrope_config(rope: dict, **top) -> dict:
    """A Phi-3 ``config.json`` of :data:`SHAPE` and an original context of 64, its
    ``rope_scaling`` ``rope`` over the ``phi3_longrope`` factors, ``top`` over the rest
    (None: left out)."""
    factors = {k: longrope(16)["rope_parameters"][k] for k in ("short_factor", "long_factor")}
    raw = {**SHAPE, "model_type": "phi3", "rope_theta": 10000.0, "original_max_position_embeddings": 64,
           "rope_scaling": {**factors, **rope}, **top}
    return {k: v for k, v in raw.items() if v is not None}


@pytest.mark.parametrize("rope, top", [
    ({"type": "longrope"}, {}),  # Phi-3.5-mini's and the 128k Phi-3's config.json
    ({"rope_type": "longrope", "factor": 2.0}, {}),  # the factor, not the contexts' ratio, sets the scale
    ({"rope_type": "longrope", "attention_factor": 1.25}, {}),
    ({"type": "longrope"}, {"original_max_position_embeddings": None}),  # Phi3Config's default: 4096
])
def test_longrope_rope_table_equals_transformers(rope, top):
    """Every position's cos and sin, bit for bit, as transformers' Phi-3 rotary embedding
    computes them within the original context."""
    from transformers.models.phi3.modeling_phi3 import Phi3RotaryEmbedding

    raw = _longrope_config(rope, **top)
    ours = phi3_config(raw)
    theirs = Phi3RotaryEmbedding(transformers.Phi3Config(**raw))
    assert ours.max_position_embeddings == min(256, raw.get("original_max_position_embeddings", 4096))
    assert ours.rope_scaling.attention_factor == theirs.attention_scaling
    positions, half = torch.arange(ours.max_position_embeddings)[None], ours.head_dim // 2
    cos, sin = theirs(torch.zeros(1, dtype=torch.float32), positions)  # [1, P, D]: each half twice
    assert torch.equal(rope_table(ours, torch.float32), torch.cat([cos[0, :, :half], sin[0, :, :half]], dim=-1))


def test_longrope_su_is_longrope():
    """The 128k Phi-3's first config.json named it ``su``, which Phi3Config renames (and
    transformers 5.24 then refuses for want of the original context inside it)."""
    assert phi3_config(_longrope_config({"type": "su"})) == phi3_config(_longrope_config({"type": "longrope"}))


@pytest.mark.parametrize("source", ["hf", "gguf"])
def test_longrope_prompt_past_the_original_context_is_refused(tmp_path, source):
    ref = build_checkpoint(tmp_path, "phi3_longrope")
    path = tmp_path
    if source == "gguf":
        path = tmp_path / "phi3.gguf"
        write_llama_cpp_gguf(path, "phi3", ref)
    engine = TreeEngine(*load_model(path), num_pages=64, page_size=16, backend="torch")
    with pytest.raises(ValueError, match=r"prompts\[0\]: the prompt has 90 tokens, more than the model's "
                                         r"context of 64 \(LongRoPE's original context"):
        generate(engine, [TINY_PROMPTS[2]], SamplingParams(max_new_tokens=1))


def test_longrope_gguf_attention_factor(tmp_path):
    """The file's ``attn_factor``; where it is left out, LongRoPE's default from the contexts."""
    ref = build_checkpoint(tmp_path / "hf", "phi3_longrope")
    path = tmp_path / "phi3.gguf"
    for attn, want in [(1.5, 1.5), (None, pytest.approx(math.sqrt(1 + math.log(4) / math.log(64))))]:
        write_llama_cpp_gguf(path, "phi3", ref, rope_scaling_attn_factors=attn)
        assert load_model(path)[0].config.rope_scaling.attention_factor == want


def test_longrope_config_is_capped_at_the_original_context():
    scaling = RopeScaling("longrope", 4.0, original_max_position_embeddings=64, short_factor=(1.0,) * 8)
    assert LlamaConfig(100, 64, 96, 1, 4, 2, rope_scaling=scaling, max_position_embeddings=64).rope_scaling == scaling
    with pytest.raises(ValueError, match=r"max_position_embeddings: expected at most rope_scaling.original_max_"
                                         r"position_embeddings=64 \(LongRoPE's short factors hold only within "
                                         r"it\), got 65"):
        LlamaConfig(100, 64, 96, 1, 4, 2, rope_scaling=scaling, max_position_embeddings=65)
    with pytest.raises(ValueError, match=r"rope_scaling.short_factor: expected one per rotated pair of dims, 8 values, got 4"):
        LlamaConfig(100, 64, 96, 1, 4, 2, max_position_embeddings=64,
                    rope_scaling=RopeScaling("longrope", 4.0, original_max_position_embeddings=64,
                                             short_factor=(1.0,) * 4))
    with pytest.raises(ValueError, match=r"rope_scaling.short_factor: expected a list of numbers, got None"):
        phi3_config(_longrope_config({"type": "su", "short_factor": None}))


# ---------------------------------------------------------------- chat templates


# Written for the test in the style of each family's shipped template (the Jinja features they use).
TEMPLATES = {
    "qwen": (
        "{%- if messages[0]['role'] == 'system' %}{{- '<|im_start|>system\\n' + messages[0]['content'] + "
        "'<|im_end|>\\n' }}{%- else %}{{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}"
        "{%- endif %}{%- set ns = namespace(last_query=messages|length - 1) %}"
        "{%- for m in messages[::-1] %}{%- if m.role == 'user' and m.content is string %}"
        "{%- set ns.last_query = (messages|length - 1) - loop.index0 %}{%- break %}{%- endif %}{%- endfor %}"
        "{%- for m in messages %}{%- if m.role == 'user' or (m.role == 'system' and not loop.first) %}"
        "{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}{%- elif m.role == 'assistant' %}"
        "{%- set content = m.content.split('</think>')[-1].lstrip('\\n') if '</think>' in m.content else m.content %}"
        "{{- '<|im_start|>assistant\\n' + content.strip() + '<|im_end|>\\n' }}{%- endif %}{%- endfor %}"
        "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
        "{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}"
        "{%- endif %}{%- endif %}"),
    "phi3": (
        "{% for message in messages %}{% if message['role'] == 'system' %}{{'<|system|>\\n' + message['content'] "
        "+ '<|end|>\\n'}}{% elif message['role'] == 'user' %}{{'<|user|>\\n' + message['content'] + '<|end|>\\n'}}"
        "{% elif message['role'] == 'assistant' %}{{'<|assistant|>\\n' + message['content'] + '<|end|>\\n'}}"
        "{% endif %}{% endfor %}{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% else %}{{ eos_token }}"
        "{% endif %}"),
    "mistral": (
        "{{- bos_token }}{%- for message in messages %}"
        "{%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
        "{{- raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}"
        "{%- endif %}{%- if message['role'] == 'user' %}{{- '[INST] ' + message['content'] + '[/INST]' }}"
        "{%- else %}{{- message['content'] + eos_token }}{%- endif %}{%- endfor %}"),
    "gemma": (
        "{{ bos_token }}{%- if messages[0]['role'] == 'system' -%}"
        "{%- set first_user_prefix = messages[0]['content'] + '\n\n' -%}{%- set loop_messages = messages[1:] -%}"
        "{%- else -%}{%- set first_user_prefix = '' -%}{%- set loop_messages = messages -%}{%- endif -%}"
        "{%- for message in loop_messages -%}{%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}"
        "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{%- endif -%}"
        "{%- set role = 'model' if message['role'] == 'assistant' else message['role'] -%}"
        "{{ '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else '') }}"
        "{%- if message['content'] is string -%}{{ message['content'] | trim }}"
        "{%- else -%}{{ raise_exception('Invalid content type') }}{%- endif -%}{{ '<end_of_turn>\n' }}"
        "{%- endfor -%}{%- if add_generation_prompt -%}{{ '<start_of_turn>model\n' }}{%- endif -%}"),
}
CHATS = [
    [{"role": "user", "content": "Hi!"}],
    [{"role": "user", "content": "Hi!"}, {"role": "assistant", "content": "<think>\nhm</think>\n\nHello. "},
     {"role": "user", "content": "2+2?"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Why?"}],
]


@pytest.mark.parametrize("style", sorted(TEMPLATES))
def test_chat_templates_render_as_transformers(style, tmp_path):
    build_checkpoint(tmp_path, "qwen2")
    write_tokenizer(tmp_path, TEMPLATES[style], bos_token="<|endoftext|>")
    _, tok = load_model(tmp_path)
    ref = transformers.AutoTokenizer.from_pretrained(tmp_path)
    for messages in CHATS:
        if style == "mistral" and messages[0]["role"] == "system":
            continue
        for gen in (True, False):
            want = ref.apply_chat_template(messages, tokenize=False, add_generation_prompt=gen)
            assert tok.render_chat(messages, add_generation_prompt=gen) == want, (style, messages)


# ---------------------------------------------------------------- dtype, errors


def test_auto_dtype():
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert resolve_dtype("auto", cpu, "bfloat16") == torch.float32
    assert resolve_dtype("auto", cuda, "float16") == torch.float16
    assert resolve_dtype("auto", cuda, None) == resolve_dtype("auto", cuda, "int8") == torch.bfloat16
    assert resolve_dtype("bfloat16", cpu) == torch.bfloat16
    with pytest.raises(ValueError, match="dtype: expected one of auto, float32, float16, bfloat16, "
                                         "float64, got 'half'"):
        resolve_dtype("half", cpu)


def test_named_dtype_and_memory_mapped_load(checkpoint):
    family, folder, ref = checkpoint
    model, _ = load_model(folder, device="auto" if not torch.cuda.is_available() else "cpu", dtype="bfloat16")
    assert model.dtype == model.rope.dtype == torch.bfloat16 and model.device.type == "cpu"
    (got,) = forest_logits(model, TINY_PROMPTS[:1])
    assert_logits(got, reference_logits(ref, TINY_PROMPTS[0]), 0.5, f"{family} bf16 vs float32")


@pytest.mark.parametrize("family, change, message", [
    ("qwen3", {"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope_scaling: expected a type of linear, "
     "llama3, longrope, got 'yarn'"),
    ("phi3", {"partial_rotary_factor": 1.5}, "partial_rotary_factor: expected a number in (0, 1], got 1.5"),
    ("qwen2", {"hidden_act": "gelu"}, "hidden_act: expected one of silu, gelu_pytorch_tanh, got 'gelu'"),
])
def test_unsupported_features_name_themselves(tmp_path, family, change, message):
    build_checkpoint(tmp_path, family)
    raw = json.loads((tmp_path / "config.json").read_text())
    raw.pop("rope_parameters", None) if "rope_scaling" in change else None
    (tmp_path / "config.json").write_text(json.dumps({**raw, **change}))
    with pytest.raises(ValueError, match="config.json: " + message.replace("(", r"\(").replace(")", r"\)")):
        load_model(tmp_path)


def test_shapes_that_disagree_with_the_config_name_the_tensor(tmp_path):
    build_checkpoint(tmp_path, "qwen3")
    raw = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**raw, "head_dim": 16}))
    with pytest.raises(ValueError, match=r"tensor 'model.layers.0.self_attn.q_proj.weight' has shape "
                                         r"\(96, 64\), expected \(64, 64\) from the config"):
        load_model(tmp_path)
    build_checkpoint(tmp_path, "phi3")
    raw = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**raw, "num_key_value_heads": 4}))
    with pytest.raises(ValueError, match=r"tensor 'model.layers.0.self_attn.qkv_proj.weight' has 128 rows, "
                                         r"expected 192 from the config"):
        load_model(tmp_path)


def test_cli_dtype_and_auto_device(checkpoint, capsys):
    from deft.cli import main

    family, folder, _ = checkpoint
    if family != "qwen3":
        pytest.skip("one family is enough for the flags")
    assert main(["generate", "hello", "--model", str(folder), "--dtype", "bfloat16",
                 "--max-new-tokens", "2", "--json"]) == 0
    device = "cuda" if torch.cuda.is_available() else "cpu"
    assert f"model on {device} (--device auto), bfloat16, loaded in" in capsys.readouterr().err


def test_smollm3_nope_layers_from_the_config():
    """transformers' reading: a 0 in ``no_rope_layers`` marks a layer without RoPE; absent,
    every ``no_rope_layer_interval``-th layer (4 by default)."""
    from deft.model.smollm3 import smollm3_config

    base = dict(vocab_size=10, hidden_size=16, intermediate_size=8, num_hidden_layers=8,
                num_attention_heads=2)
    assert smollm3_config(base).nope_layers == (3, 7)
    assert smollm3_config({**base, "no_rope_layer_interval": 2}).nope_layers == (1, 3, 5, 7)
    assert smollm3_config({**base, "no_rope_layers": [0] + [1] * 7}).nope_layers == (0,)
    with pytest.raises(ValueError, match=r"no_rope_layers: expected a 0 or 1 per layer \(8\), got \[1\]"):
        smollm3_config({**base, "no_rope_layers": [1]})
    with pytest.raises(ValueError, match="no_rope_layer_interval: expected a positive integer, got 0"):
        smollm3_config({**base, "no_rope_layer_interval": 0})
