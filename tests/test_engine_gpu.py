"""The engine on a GPU (``pytest -m gpu``; skipped without CUDA).

A small random Llama-shaped model (GQA 4, head_dim 32) runs on CUDA with the ``triton``
attention backend and is checked against the ``torch`` backend on the same GPU: logits of a
tree step, greedy generation of a batch, and speculative decoding against plain greedy.
The final norm is scaled up so greedy choices have clear margins and cannot flip on
rounding differences between the backends.
"""

from __future__ import annotations

import pytest
import torch

from deft.engine import NgramDrafter, SamplingParams, TreeEngine, generate, speculative_generate
from deft.model import LlamaConfig, LlamaModel, Tokenizer

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
VOCAB = 64


def tokenizer() -> Tokenizer:
    from tokenizers import Tokenizer as Backend
    from tokenizers import models

    vocab = {f"t{i}": i for i in range(VOCAB)}
    return Tokenizer(Backend(models.WordLevel(vocab, unk_token="t0")), eos_token_ids=[])


def model(dtype: torch.dtype) -> LlamaModel:
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=256, intermediate_size=512, num_layers=3,
                         num_heads=8, num_kv_heads=2, max_position_embeddings=2048)
    m = LlamaModel(config).eval().requires_grad_(False)
    m.norm.weight.mul_(4.0)
    return m.to("cuda", dtype)


def engines(dtype: torch.dtype) -> tuple[TreeEngine, TreeEngine]:
    m = model(dtype)
    return (TreeEngine(m, tokenizer(), num_pages=512, backend="triton"),
            TreeEngine(m, tokenizer(), num_pages=512, backend="torch"))


PROMPT = [(7 * i + 3) % VOCAB for i in range(300)]


@pytest.mark.parametrize("dtype, rtol", [(torch.float32, 1e-4), (torch.bfloat16, 3e-2)])
def test_tree_step_logits_match_the_torch_backend(dtype, rtol):
    results = []
    for engine, backend in zip(engines(dtype), ("triton", "torch")):
        assert engine.attn.backend_name == backend
        root = engine.add_prompt(PROMPT)
        first = engine.extend([(root, [5])])[0]
        kids = engine.cache.fork(root, 3)
        step = engine.extend([(k, [t, t + 1]) for k, t in zip(kids, (9, 17, 33))], logits="all")
        results.append(torch.cat([first.reshape(-1, VOCAB)] + [s.reshape(-1, VOCAB) for s in step]))
    got, ref = results
    scale = ref.abs().max()
    assert float((got - ref).abs().max() / scale) < rtol


def test_greedy_batch_matches_the_torch_backend():
    params = SamplingParams(max_new_tokens=24, stop_token_ids=frozenset())
    prompts = [PROMPT[:n] for n in (40, 120, 300)] + [PROMPT[10:90]]
    tri, ref = (generate(e, prompts, params) for e in engines(torch.float32))
    assert [r.token_ids for r in tri] == [r.token_ids for r in ref]


def test_speculative_greedy_equals_plain_greedy_on_gpu():
    engine = engines(torch.float32)[0]
    params = SamplingParams(max_new_tokens=40, stop_token_ids=frozenset())
    prompts = [PROMPT[:200], PROMPT[50:150] * 2]
    plain = generate(engine, prompts, params)
    spec = speculative_generate(engine, prompts, params, NgramDrafter())
    assert [r.token_ids for r in spec] == [r.token_ids for r in plain]
    assert engine.cache.live_nodes == [] and engine.cache.num_free_pages == engine.cache.num_pages
