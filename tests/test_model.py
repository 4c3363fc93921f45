"""Model runtime: logits against transformers' LlamaForCausalLM, trees against linear runs,
both loaders on a synthetic model, tokenizer, and the errors users see.

Tolerance: float32 logits agree with transformers within ``LOGIT_ATOL`` max abs difference
(measured ~1e-4 on SmolLM2-135M, whose logits reach |40|); the torch backend's tiled
attention sums in a different order than transformers' dense attention.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
import subprocess
import sys

import numpy as np
import pytest
import torch
from safetensors.torch import save_file
from tokenizers import AddedToken, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as Backend

from deft import TreeLayout
from deft.model import LlamaConfig, LlamaModel, RopeScaling, load_model
from deft.model.gguf_file import GGUFFile
from deft.model.gguf_loader import BLOCK_NAMES
from deft.model.gguf_tokenizer import tokenizer_from_gguf
from deft.model.loader import DEFAULT_GGUF, default_model_path
from deft.model.rope import rope_inv_freq

transformers = pytest.importorskip("transformers")
try:
    import gguf
except ImportError:  # the ``model`` extra's; GPU test modules import this one's helpers
    gguf = None


def needs_gguf() -> None:
    """Skip the calling test where the ``gguf`` package (the ``model`` extra) is missing."""
    if gguf is None:
        pytest.skip("needs the gguf package: pip install -e '.[model]'")

LOGIT_ATOL = 1e-3  # float32, SmolLM2-135M against transformers
SYNTH_ATOL = 1e-4  # float32, tiny synthetic model (measured ~2e-6); GGUF vs HF directory
PAGE = 16
CHATML = (
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def assert_logits(actual: torch.Tensor, expected: torch.Tensor, atol: float, what: str) -> None:
    diff = (actual.double() - expected.double()).abs()
    worst = int(diff.argmax())
    row, col = divmod(worst, diff.shape[-1])
    assert diff.max() <= atol, (
        f"{what}: max |logit diff| {diff.max():.3g} > {atol} at row {row}, token {col} "
        f"({actual[row, col]:.5f} vs {expected[row, col]:.5f})"
    )


def run_step(model, attn, pool, nodes, queries, logits_rows=None):
    """One forward over a forest.

    ``nodes``: ``[(parent, slots)]``; ``queries``: ``[(node, kv_len, token, position)]``, each
    query's own token being the ``kv_len``-th of its node (written this step).
    """
    layout = TreeLayout.from_node_lengths(
        [p for p, _ in nodes], [len(s) for _, s in nodes], [q[0] for q in queries],
        [q[1] for q in queries], slots=[x for _, s in nodes for x in s],
    )
    attn.plan(layout)
    write = torch.tensor([nodes[n][1][k - 1] for n, k, _, _ in queries])
    ids = torch.tensor([q[2] for q in queries])
    pos = torch.tensor([q[3] for q in queries])
    rows = None if logits_rows is None else torch.tensor(logits_rows)
    return model(ids, pos, write, attn, pool, rows)


def pages(first_page: int, n: int) -> list[int]:
    """``n`` consecutive slots starting at page ``first_page``."""
    return list(range(first_page * PAGE, first_page * PAGE + n))


def forest_logits(model, prompts: list[list[int]]) -> list[torch.Tensor]:
    """Every prompt a root node, all their tokens as queries of ONE forward; per-prompt logits."""
    attn, nodes, queries, page = model.attention(backend="torch"), [], [], 1  # page 0 unused
    for i, ids in enumerate(prompts):
        nodes.append((-1, pages(page, len(ids))))
        page += -(-len(ids) // PAGE)
        queries += [(i, j + 1, t, j) for j, t in enumerate(ids)]
    out = run_step(model, attn, model.new_pool(page, PAGE), nodes, queries)
    return list(out.split([len(p) for p in prompts]))


@torch.no_grad()
def reference_logits(ref, ids: list[int]) -> torch.Tensor:
    return ref(torch.tensor([ids])).logits[0]


# ---------------------------------------------------------------- SmolLM2-135M (GGUF)


PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return",
    "Once upon a time, in a small village by the sea, there lived an old fisherman who every "
    "morning walked down to the harbour, untied his boat and",
]


def test_forest_matches_transformers(smol, smol_ref):
    model, tok = smol
    prompts = [tok.encode(PROMPTS[0]), tok.apply_chat_template(PROMPTS[1]), tok.encode(PROMPTS[2])]
    assert len({len(p) for p in prompts}) == 3
    for ids, got in zip(prompts, forest_logits(model, prompts)):
        assert_logits(got, reference_logits(smol_ref, ids), LOGIT_ATOL, f"prompt of {len(ids)} tokens")


def test_tree_branches_match_linear_runs(smol, smol_ref):
    """Prompt prefilled in step 1; two continuations in step 2 share its KV as a tree."""
    model, tok = smol
    prompt = tok.encode(PROMPTS[2])
    branch_a, branch_b = tok.encode(" rowed out"), tok.encode(" sang a song to the gulls, then slept")
    n, attn, pool = len(prompt), model.attention(backend="torch"), model.new_pool(12, PAGE)
    p_slots = pages(0, n)
    last = run_step(model, attn, pool, [(-1, p_slots)],
                    [(0, j + 1, t, j) for j, t in enumerate(prompt)], logits_rows=[n - 1])
    a_page = -(-n // PAGE)
    a_slots, b_slots = pages(a_page, len(branch_a)), pages(a_page + 1, len(branch_b))
    queries = [(1, j + 1, t, n + j) for j, t in enumerate(branch_a)]
    queries += [(2, j + 1, t, n + j) for j, t in enumerate(branch_b)]
    out = run_step(model, attn, pool, [(-1, p_slots), (0, a_slots), (0, b_slots)], queries)
    got_a, got_b = out.split([len(branch_a), len(branch_b)])
    ref_a = reference_logits(smol_ref, prompt + branch_a)
    ref_b = reference_logits(smol_ref, prompt + branch_b)
    assert_logits(last, ref_a[n - 1:n], LOGIT_ATOL, "prefill, last prompt row")
    assert_logits(got_a, ref_a[n:], LOGIT_ATOL, "branch a vs transformers")
    assert_logits(got_b, ref_b[n:], LOGIT_ATOL, "branch b vs transformers")
    # Our own linear run of the full sequence: same model, different tiling of the KV.
    (lin_b,) = forest_logits(model, [prompt + branch_b])
    assert_logits(got_b, lin_b[n:], 1e-4, "branch b vs linear run")


def test_greedy_decode_matches_transformers(smol, smol_ref):
    """One token per step (plan per step) reproduces transformers' greedy generation."""
    model, tok = smol
    prompt = tok.apply_chat_template("Name three colours.")
    n, steps = len(prompt), 12
    attn, pool = model.attention(backend="torch"), model.new_pool(-(-(n + steps) // PAGE), PAGE)
    logits = run_step(model, attn, pool, [(-1, pages(0, n))],
                      [(0, j + 1, t, j) for j, t in enumerate(prompt)], logits_rows=[n - 1])
    out = []
    for step in range(steps):
        out.append(int(logits[-1].argmax()))
        length = n + step + 1
        logits = run_step(model, attn, pool, [(-1, pages(0, length))],
                          [(0, length, out[-1], length - 1)])
    ref = smol_ref.generate(torch.tensor([prompt]), max_new_tokens=steps, do_sample=False,
                            attention_mask=torch.ones(1, n, dtype=torch.long))[0, n:].tolist()
    assert len(ref) > 3 and out[:len(ref)] == ref, (tok.decode(out), tok.decode(ref))


@pytest.mark.parametrize("dtype, atol", [(torch.bfloat16, 1.5), (torch.float16, 0.5)])
def test_half_precision_model(smol_ref, dtype, atol):
    """Against float32 transformers: the rounding of 30 layers (measured 0.56 bf16, 0.09 fp16)."""
    model, tok = load_model(dtype=dtype)
    assert model.dtype == dtype and model.rope.dtype == dtype
    ids = tok.encode(PROMPTS[0])
    (got,) = forest_logits(model, [ids])
    ref = reference_logits(smol_ref, ids)
    assert got.dtype == torch.float32 and got.argmax(-1)[-1] == ref.argmax(-1)[-1]
    assert_logits(got, ref, atol, f"{dtype} vs float32 transformers")


def test_smollm2_tokenizer(smol):
    _, tok = smol
    ref = transformers.AutoTokenizer.from_pretrained(
        os.path.dirname(default_model_path()), gguf_file=DEFAULT_GGUF)
    for text in PROMPTS + ["  tabs\tand\n\nnewlines", "Ünïcödé — 日本語 🎉", "x = 3.14159 * 2"]:
        assert tok.encode(text) == ref.encode(text), text
        assert tok.decode(tok.encode(text)) == text
    messages = [{"role": "user", "content": "Hi!"}, {"role": "assistant", "content": "Hello."},
                {"role": "user", "content": "What is 2+2?"}]
    expected = ref.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                       return_dict=False)
    assert tok.apply_chat_template(messages) == list(expected)
    assert tok.eos_token_ids == {tok.token_id("<|im_end|>"), tok.token_id("<|endoftext|>")} == {0, 2}


def test_loaded_model_is_inference_ready(smol):
    model, _ = smol
    assert not any(p.requires_grad for p in model.parameters())
    assert model.config.tie_word_embeddings and model.lm_head is None
    assert (model.config.num_heads, model.config.num_kv_heads, model.config.head_dim) == (9, 3, 64)


# ---------------------------------------------------------------- synthetic tiny Llama 3


TINY = {
    "model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_act": "silu",
    "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 24,
    "rms_norm_eps": 1e-6, "rope_theta": 500000.0, "max_position_embeddings": 256,
    "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                     "high_freq_factor": 4.0, "original_max_position_embeddings": 32},
    "tie_word_embeddings": False, "bos_token_id": 0, "eos_token_id": 2,
}
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
MERGES = [("h", "e"), ("l", "l"), ("Ġ", "w"), ("o", "r")]


def tiny_vocab() -> list[str]:
    """Specials, the 256 byte-level symbols, then the merged tokens."""
    return SPECIALS + sorted(pre_tokenizers.ByteLevel.alphabet()) + [a + b for a, b in MERGES]


TINY_CONFIG = LlamaConfig.from_hf_config({**TINY, "vocab_size": len(tiny_vocab())})


def tiny_weights(config: LlamaConfig, seed: int = 0):
    """Random HF-named weights and the GGUF blocks of the quantised ones.

    Matrices are rounded through float16 (the GGUF stores them as F16); the embedding and
    the gate projections are the dequantised values of Q8_0 / Q4_1 blocks, so both files
    hold exactly the same numbers.
    """
    needs_gguf()
    g = torch.Generator().manual_seed(seed)
    h, i, d = config.hidden_size, config.intermediate_size, config.head_dim
    blocks = {}

    def lin(rows, cols, scale=1.0):
        return (scale * torch.randn(rows, cols, generator=g) / cols**0.5).half().float()

    def quant(name, w, qtype):
        blocks[name] = (qtype, gguf.quants.quantize(w.numpy(), qtype))
        return torch.from_numpy(gguf.quants.dequantize(blocks[name][1], qtype).copy())

    w = {"model.embed_tokens.weight": quant("model.embed_tokens.weight", torch.randn(
             config.vocab_size, h, generator=g), gguf.GGMLQuantizationType.Q8_0),
         "model.norm.weight": 1 + 0.1 * torch.randn(h, generator=g),
         "lm_head.weight": lin(config.vocab_size, h)}
    for layer in range(config.num_layers):
        p = f"model.layers.{layer}."
        w[p + "input_layernorm.weight"] = 1 + 0.1 * torch.randn(h, generator=g)
        w[p + "post_attention_layernorm.weight"] = 1 + 0.1 * torch.randn(h, generator=g)
        w[p + "self_attn.q_proj.weight"] = lin(config.num_heads * d, h, scale=1.5)
        w[p + "self_attn.k_proj.weight"] = lin(config.num_kv_heads * d, h, scale=1.5)
        w[p + "self_attn.v_proj.weight"] = lin(config.num_kv_heads * d, h)
        w[p + "self_attn.o_proj.weight"] = lin(h, config.num_heads * d)
        w[p + "mlp.gate_proj.weight"] = quant(p + "mlp.gate_proj.weight", lin(i, h),
                                              gguf.GGMLQuantizationType.Q4_1)
        w[p + "mlp.up_proj.weight"] = lin(i, h)
        w[p + "mlp.down_proj.weight"] = lin(h, i)
    return w, blocks


def write_hf_dir(folder, raw_config: dict, weights: dict[str, torch.Tensor]) -> None:
    """config.json, two safetensors shards with an index, tokenizer.json and its config."""
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, "config.json"), "w") as fh:
        json.dump(raw_config, fh)
    names = sorted(weights)
    shards = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    for file, part in shards.items():
        save_file({n: weights[n].contiguous() for n in part}, os.path.join(folder, file))
    index = {"metadata": {}, "weight_map": {n: f for f, part in shards.items() for n in part}}
    with open(os.path.join(folder, "model.safetensors.index.json"), "w") as fh:
        json.dump(index, fh)
    write_tokenizer(folder)


def write_tokenizer(folder, chat_template: str = CHATML, bos_token: str | None = None) -> None:
    """tokenizer.json (byte-level BPE of :func:`tiny_vocab`) and tokenizer_config.json."""
    vocab = tiny_vocab()
    backend = Backend(models.BPE({t: i for i, t in enumerate(vocab)}, MERGES))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIALS])
    backend.save(os.path.join(folder, "tokenizer.json"))
    with open(os.path.join(folder, "tokenizer_config.json"), "w") as fh:
        json.dump({"eos_token": "<|im_end|>", "bos_token": bos_token, "chat_template": chat_template}, fh)


def permute_for_gguf(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's q/k row order (the inverse of what the loader undoes)."""
    rows = w.shape[0]
    return w.reshape(n_head, 2, rows // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def add_tiny_tokenizer(w: gguf.GGUFWriter, pre: str) -> None:
    """The tiny byte-level BPE tokenizer (ChatML template) as GGUF metadata, pre-tokenizer ``pre``."""
    vocab = tiny_vocab()
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(pre)
    w.add_token_list(vocab)
    w.add_token_merges([f"{a} {b}" for a, b in MERGES])
    w.add_token_types([3 if t in SPECIALS else 1 for t in vocab])
    w.add_eos_token_id(vocab.index("<|im_end|>"))
    w.add_chat_template(CHATML)


def write_gguf(path, config: LlamaConfig, weights, blocks, arch: str = "llama") -> None:
    """The same model as a GGUF: Llama 3 scaling as a rope_freqs tensor, mixed F32/F16/Q8_0/Q4_1."""
    needs_gguf()
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(config.num_layers)
    w.add_context_length(config.max_position_embeddings)
    w.add_embedding_length(config.hidden_size)
    w.add_feed_forward_length(config.intermediate_size)
    w.add_head_count(config.num_heads)
    w.add_head_count_kv(config.num_kv_heads)
    w.add_key_length(config.head_dim)
    w.add_value_length(config.head_dim)
    w.add_rope_dimension_count(config.head_dim)
    w.add_rope_freq_base(config.rope_theta)
    w.add_layer_norm_rms_eps(config.rms_norm_eps)
    w.add_vocab_size(config.vocab_size)
    add_tiny_tokenizer(w, "default")
    plain = dataclasses.replace(config, rope_scaling=None)
    w.add_tensor("rope_freqs.weight", (rope_inv_freq(plain) / rope_inv_freq(config)).numpy())
    rename = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
              "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
              "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
              "mlp.down_proj": "ffn_down"}
    for name, t in weights.items():
        a = t.numpy()
        if name.startswith("model.layers."):
            _, _, layer, rest = name.split(".", 3)
            kind = rename[rest.removesuffix(".weight")]
            out = f"blk.{layer}.{kind}.weight"
            if kind in ("attn_q", "attn_k"):
                a = permute_for_gguf(a, config.num_heads if kind == "attn_q" else config.num_kv_heads)
        else:
            out = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
                   "lm_head.weight": "output.weight"}[name]
        if name in blocks:
            w.add_tensor(out, blocks[name][1], raw_dtype=blocks[name][0])
        else:
            w.add_tensor(out, a.astype(np.float16) if a.ndim == 2 else a)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(HF directory, GGUF path, weights, quantised blocks) of one random tiny Llama 3 model."""
    root = tmp_path_factory.mktemp("tiny")
    weights, blocks = tiny_weights(TINY_CONFIG)
    hf_dir, gguf_path = root / "hf", root / "tiny.gguf"
    write_hf_dir(hf_dir, {**TINY, "vocab_size": TINY_CONFIG.vocab_size}, weights)
    write_gguf(gguf_path, TINY_CONFIG, weights, blocks)
    return hf_dir, gguf_path, weights, blocks


TINY_PROMPTS = [[5, 77, 260, 3], list(range(10, 60, 3)), [int(x) for x in np.random.default_rng(1).integers(3, 262, 90)]]


@pytest.mark.parametrize("dtype, atol", [(torch.float32, SYNTH_ATOL), (torch.float64, 1e-10)])
def test_hf_dir_matches_transformers(tiny, dtype, atol):
    hf_dir = tiny[0]
    model, _ = load_model(hf_dir, dtype=dtype)
    c = model.config
    assert c.rope_scaling == RopeScaling("llama3", 8.0, 1.0, 4.0, 32) and not c.tie_word_embeddings
    assert c.head_dim == 24 and model.lm_head is not None
    ref = transformers.LlamaForCausalLM.from_pretrained(hf_dir, dtype=dtype).eval()
    for ids, got in zip(TINY_PROMPTS, forest_logits(model, TINY_PROMPTS)):
        assert got.dtype == dtype
        assert_logits(got, reference_logits(ref, ids), atol, f"tiny HF {dtype}, {len(ids)} tokens")


def test_gguf_matches_hf_dir(tiny):
    hf_dir, gguf_path = tiny[:2]
    hf_model, hf_tok = load_model(hf_dir)
    gg_model, gg_tok = load_model(gguf_path)
    assert gg_model.config.rope_freq_factors is not None and gg_model.config.rope_scaling is None
    torch.testing.assert_close(gg_model.rope, hf_model.rope, atol=1e-6, rtol=0)
    for name, t in hf_model.state_dict().items():
        torch.testing.assert_close(gg_model.state_dict()[name], t, atol=0, rtol=0, msg=name)
    for ids, a, b in zip(TINY_PROMPTS, forest_logits(gg_model, TINY_PROMPTS), forest_logits(hf_model, TINY_PROMPTS)):
        assert_logits(a, b, SYNTH_ATOL, f"tiny GGUF vs HF, {len(ids)} tokens")
    assert gg_tok.encode("hello world") == hf_tok.encode("hello world")
    for tok in (hf_tok, gg_tok):
        assert tok.decode(tok.encode("hello world")) == "hello world"
        assert tok.eos_token_ids == {0, 2}  # <|im_end|> and <|endoftext|>
        assert tok.decode(tok.apply_chat_template("hi")) == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


def test_gguf_slices_dequantise_as_the_whole_tensor_sliced(tiny):
    """Rows, and columns on or off quantisation blocks, of every tensor (F32, F16, Q8_0,
    Q4_1): equal to the whole tensor sliced; q/k rows of whole heads come back un-permuted
    like the whole; the loader's ``read_slice`` is what a tensor-parallel rank reads."""
    from deft.model.gguf_loader import _Tensors

    f = GGUFFile(tiny[1])
    for name, t in f.tensors.items():
        whole = f.dequantize(name)
        if len(t.shape) == 1:
            np.testing.assert_array_equal(f.dequantize(name, 0, 3, 9), whole[3:9])
            continue
        rows, cols = t.shape
        for dim, start, stop in ((0, 0, rows // 2), (0, rows // 3, rows), (1, 0, 32),
                                 (1, 32, cols), (1, 8, 40)):
            got = f.dequantize(name, dim, start, stop)
            want = whole[start:stop] if dim == 0 else whole[:, start:stop]
            assert got.flags.c_contiguous, name
            np.testing.assert_array_equal(got, want, err_msg=f"{name} dim {dim} [{start}, {stop})")
    tensors = _Tensors(f, TINY_CONFIG, True, BLOCK_NAMES, 0.0)
    d = TINY_CONFIG.head_dim
    for hf in ("model.layers.0.self_attn.q_proj.weight", "model.layers.1.self_attn.k_proj.weight"):
        whole = tensors[hf]
        for start, stop in ((0, d), (d, 2 * d), (0, 2 * d), (5, 30)):
            torch.testing.assert_close(tensors.read_slice(hf, 0, start, stop), whole[start:stop],
                                       atol=0, rtol=0)
        torch.testing.assert_close(tensors.read_slice(hf, 1, 16, 48), whole[:, 16:48], atol=0, rtol=0)


def test_gguf_tokenizer_options(tiny):
    meta = {**GGUFFile(tiny[1]).metadata, "tokenizer.ggml.add_bos_token": True,
            "tokenizer.ggml.bos_token_id": 1}
    tok = tokenizer_from_gguf(meta, "x.gguf")
    assert tok.encode("hello")[0] == 1 and tok.encode("hello", add_special_tokens=False)[0] != 1
    meta["tokenizer.ggml.pre"] = "falcon"
    with pytest.raises(ValueError, match="x.gguf: tokenizer.ggml.pre: expected one of default, "):
        tokenizer_from_gguf(meta, "x.gguf")
    meta["tokenizer.ggml.model"] = "bert"
    with pytest.raises(ValueError, match="tokenizer.ggml.model: expected 'gpt2' or 'llama', got 'bert'"):
        tokenizer_from_gguf(meta, "x.gguf")


def test_model_helpers(tiny):
    model, _ = load_model(tiny[0], dtype=torch.float64)
    pool = model.new_pool(3, PAGE)
    assert pool.k[0].dtype == torch.float64 and pool.k[0].shape == (3, PAGE, 2, 24)
    attn = model.attention(backend="torch")
    assert (attn.num_qo_heads, attn.num_kv_heads, attn.head_dim) == (4, 2, 24)


# ---------------------------------------------------------------- errors


def test_missing_paths(tmp_path):
    for path in (tmp_path / "nope.gguf", tmp_path / "nope"):
        with pytest.raises(FileNotFoundError, match=re.escape(str(path))):
            load_model(path)
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_model(tmp_path)


def test_corrupt_gguf(tiny, tmp_path):
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"PK\x03\x04" + bytes(100))
    with pytest.raises(ValueError, match=re.escape(f"{junk}: not a GGUF file")):
        load_model(junk)
    data = tiny[1].read_bytes()
    for cut in (200, len(data) - 1000):  # inside the metadata, inside the tensor data
        cut_file = tmp_path / f"cut{cut}.gguf"
        cut_file.write_bytes(data[:cut])
        with pytest.raises(ValueError, match=re.escape(f"{cut_file}: corrupt GGUF file")):
            load_model(cut_file)


def test_unsupported_gguf(tiny, tmp_path):
    path = tmp_path / "falcon.gguf"
    write_gguf(path, TINY_CONFIG, tiny[2], tiny[3], arch="falcon")
    with pytest.raises(ValueError, match=re.escape(path.as_posix()) + ".*general.architecture: "
                       "expected one of llama, qwen2, qwen3, phi3, gemma3, got 'falcon'"):
        load_model(path)


def test_bad_hf_dirs(tiny, tmp_path):
    hf_dir = tmp_path / "hf"
    shutil.copytree(tiny[0], hf_dir)
    config_file = hf_dir / "config.json"
    config_file.write_text(json.dumps({**TINY, "model_type": "gpt2"}))
    with pytest.raises(ValueError, match="config.json: model_type: expected one of llama, mistral, qwen2, qwen3, "):
        load_model(hf_dir)
    config_file.write_text(json.dumps({**TINY, "vocab_size": 300, "rope_scaling": {"rope_type": "yarn", "factor": 2.0}}))
    with pytest.raises(ValueError, match="rope_scaling: expected a type of linear, llama3, longrope, got 'yarn'"):
        load_model(hf_dir)
    config_file.write_text(json.dumps({**TINY, "vocab_size": 300}))  # weights hold fewer rows
    with pytest.raises(ValueError, match=r"'model.embed_tokens.weight' has shape \(\d+, 64\), expected \(300, 64\)"):
        load_model(hf_dir)
    (hf_dir / "model-00001-of-00002.safetensors").write_bytes(b"garbage")
    with pytest.raises(ValueError, match="model-00001-of-00002.safetensors: corrupt safetensors"):
        load_model(hf_dir)
    (hf_dir / "model-00001-of-00002.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="model-00001-of-00002.safetensors: listed in the index"):
        load_model(hf_dir)


def test_missing_tensor_and_tokenizer(tiny, tmp_path):
    hf_dir = tmp_path / "hf"
    shutil.copytree(tiny[0], hf_dir)
    weights = dict(tiny[2])
    del weights["model.layers.1.mlp.up_proj.weight"]
    write_hf_dir(hf_dir, {**TINY, "vocab_size": TINY_CONFIG.vocab_size}, weights)
    with pytest.raises(ValueError, match="missing tensor 'model.layers.1.mlp.up_proj.weight'"):
        load_model(hf_dir)
    write_hf_dir(hf_dir, {**TINY, "vocab_size": TINY_CONFIG.vocab_size}, tiny[2])
    (hf_dir / "tokenizer.json").unlink()
    with pytest.raises(FileNotFoundError, match="tokenizer.json: not found"):
        load_model(hf_dir)


@pytest.mark.parametrize("change, message", [
    ({"num_attention_heads": 4, "num_key_value_heads": 3}, "num_heads: expected a multiple of num_kv_heads=3"),
    ({"head_dim": 25}, "head_dim: expected an even number"),
    ({"partial_rotary_factor": 0.75, "head_dim": 18}, "rotary_dim: expected an even number .*, got 13"),
    ({"partial_rotary_factor": 0.01}, "partial_rotary_factor: rotates 0 of a head's 24 dims, expected at least 2"),
    ({"partial_rotary_factor": 0}, r"partial_rotary_factor: expected a number in \(0, 1\], got 0"),
    ({"hidden_act": "gelu"}, "hidden_act: expected one of silu, gelu_pytorch_tanh, got 'gelu'"),
    ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 4.0,
                       "high_freq_factor": 1.0}}, "high_freq_factor: expected > low_freq_factor"),
    ({"intermediate_size": 0}, "intermediate_size: expected a positive integer, got 0"),
])
def test_config_validation(change, message):
    with pytest.raises(ValueError, match=message):
        LlamaConfig.from_hf_config({**TINY, "vocab_size": 100, **change})


def test_huge_context_is_a_named_error():
    """A context whose RoPE table cannot be exact (float32 positions) is rejected by name."""
    with pytest.raises(ValueError, match=r"max_position_embeddings: expected an integer in \[1, 16777216\]"):
        LlamaConfig.from_hf_config({**TINY, "vocab_size": 100, "max_position_embeddings": 10**12})
    with pytest.raises(ValueError, match="max_position_embeddings: expected an integer in"):
        LlamaConfig(100, 32, 64, 1, 2, 2, max_position_embeddings=2**63)


def test_tied_config_with_a_distinct_stored_head_follows_transformers(tiny, tmp_path):
    """transformers unties a tied config whose checkpoint stores a different lm_head (with a
    warning) and uses the stored head; so do we."""
    hf_dir = tmp_path / "hf"
    write_hf_dir(hf_dir, {**TINY, "vocab_size": TINY_CONFIG.vocab_size, "tie_word_embeddings": True}, tiny[2])
    with pytest.warns(UserWarning, match="lm_head.weight.*differs from model.embed_tokens.weight"):
        model, _ = load_model(hf_dir)
    assert model.lm_head is not None and not model.config.tie_word_embeddings
    ref = transformers.LlamaForCausalLM.from_pretrained(hf_dir).eval()
    assert not torch.equal(ref.lm_head.weight, ref.model.embed_tokens.weight)
    for ids, got in zip(TINY_PROMPTS, forest_logits(model, TINY_PROMPTS)):
        assert_logits(got, reference_logits(ref, ids), SYNTH_ATOL, f"tied config, stored head, {len(ids)} tokens")
    same = {**tiny[2], "lm_head.weight": tiny[2]["model.embed_tokens.weight"].clone()}
    write_hf_dir(hf_dir, {**TINY, "vocab_size": TINY_CONFIG.vocab_size, "tie_word_embeddings": True}, same)
    model, _ = load_model(hf_dir)  # an identical stored head stays tied, without a warning
    assert model.lm_head is None and model.config.tie_word_embeddings


def test_forward_argument_errors(tiny):
    model, _ = load_model(tiny[0])
    attn, pool = model.attention(backend="torch"), model.new_pool(1, PAGE)
    attn.plan(TreeLayout.from_node_lengths([-1], [3], [0, 0, 0], [1, 2, 3]))
    ids, pos = torch.tensor([5, 6, 7]), torch.arange(3)
    with pytest.raises(ValueError, match="write_slots: expected length 3 like input_ids, got 2"):
        model(ids, pos, torch.arange(2), attn, pool)
    with pytest.raises(TypeError, match="positions: expected a 1-D int64 tensor, got torch.float32"):
        model(ids, pos.float(), pos, attn, pool)
    with pytest.raises(ValueError, match="attn: expected a plan for 2 queries"):
        model(ids[:2], pos[:2], pos[:2], attn, pool)
    with pytest.raises(TypeError, match="pool: expected dtype torch.float32"):
        model(ids, pos, pos, attn, model.new_pool(1, PAGE, dtype=torch.float16))
    with pytest.raises(ValueError, match="pool: expected layers/kv heads/head dim 2/2/24"):
        model(ids, pos, pos, attn, LlamaModel(LlamaConfig(100, 32, 64, 1, 2, 2)).new_pool(1, PAGE))
    assert model(ids, pos, pos, attn, pool, torch.tensor([2])).shape == (1, model.config.vocab_size)


@pytest.mark.parametrize("arch, two_spaces", [("llama", ["▁", "▁hello"]), ("phi3", ["▁", "▁", "▁hello"])])
def test_sentencepiece_gguf_tokenizer(tmp_path, arch, two_spaces):
    """Llama 2 / Mistral / Phi-3 GGUF vocabularies (tokenizer.ggml.model "llama") go through
    transformers, which gives Phi-3's its prefix-space normalizer (one more space kept)."""
    pieces = ["▁h", "el", "lo", "▁w", "or", "ld", "▁hel", "▁hello", "▁wor", "▁world", "▁", "h", "e", "l",
              "o", "w", "r", "d"]
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{i:02X}>" for i in range(256)] + pieces
    needs_gguf()
    path = tmp_path / "spm.gguf"
    w = gguf.GGUFWriter(str(path), arch)
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_token_scores([0.0] * 259 + [-float(i) for i in range(len(pieces))])
    w.add_token_types([2, 3, 3] + [6] * 256 + [1] * len(pieces))  # unknown, control, byte, normal
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_add_bos_token(True)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    tok = tokenizer_from_gguf(GGUFFile(path).metadata, str(path))
    ids = tok.encode("hello world")
    assert [tokens[i] for i in ids] == ["<s>", "▁hello", "▁world"]
    assert [tokens[i] for i in tok.encode("  hello")] == ["<s>", *two_spaces]
    assert tok.decode(tok.encode("hi"), skip_special_tokens=True) == "hi"  # "i" by byte fallback
    assert tok.eos_token_ids == {2}


def test_rope_placeholders_on_the_meta_device_have_the_real_tables_shape():
    """``build_model`` makes the model on the meta device, then the real tables; the meta
    placeholders are made from the shape alone, which must be the tables' (a guard of that
    shape, not of the time the shortcut saves)."""
    from deft.model.rope import rope_table

    config = LlamaConfig(100, 32, 64, 1, 2, 2, max_position_embeddings=4096,
                         local_rope_theta=10_000.0, local_rope_layers=(0,))
    with torch.device("meta"):
        model = LlamaModel(config)
    for buf, local in ((model.rope, False), (model.local_rope, True)):
        real = rope_table(config, torch.float32, local=local)
        assert buf.is_meta and buf.shape == real.shape == (4096, 16) and buf.dtype == real.dtype


def test_without_gguf_hf_dirs_load_and_gguf_files_name_the_package(tiny):
    """The ``gguf`` package (the ``model`` extra) is needed for GGUF files only."""
    hf_dir, gguf_path = tiny[0], tiny[1]
    script = f"""
import re, sys
sys.modules["gguf"] = None  # import gguf raises ImportError
import torch
from deft.model import load_model
model, tok = load_model({str(hf_dir)!r})
assert model.config.num_layers > 0 and tok.encode("hi")
try:
    load_model({str(gguf_path)!r})
except ImportError as exc:
    assert {str(gguf_path)!r} in str(exc) and "gguf package" in str(exc), exc
else:
    raise AssertionError("a GGUF file loaded without the gguf package")
print("ok")
"""
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]
