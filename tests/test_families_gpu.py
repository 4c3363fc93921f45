"""Each family in its real format on a GPU (``pytest -m gpu``; skipped without CUDA).

A tiny random checkpoint per family (heads of 32; Phi-3's of 24, whose real heads of 96 are
not a power of two either: the kernels' blocks pad them), saved by transformers and loaded onto CUDA by :func:`deft.model.load_model` (memory-mapped,
straight to the device): in float32 its greedy and beam-search tokens equal transformers'
``generate`` on the same GPU, with the ``triton`` attention backend; in bfloat16 its logits stay
within bf16 rounding of the float32 transformers model and agree on the first greedy token.
"""

from __future__ import annotations

import pytest
import torch

from deft.engine import SamplingParams, TreeEngine, beam_search, generate
from test_families import EOS, FAMILIES, build_checkpoint, longrope
from test_model import TINY_PROMPTS

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
transformers = pytest.importorskip("transformers")

GPU_SHAPE = {"hidden_size": 128, "head_dim": 32}  # 4 heads of 32
PADDED = {"hidden_size": 96, "head_dim": 24}  # 4 heads of 24, in blocks of 32
# LongRoPE's factors for that head_dim, and an original context that holds every prompt
GPU_CHANGES = {"phi3": PADDED, "phi3_longrope": {**PADDED, **longrope(24, original=128)},
               "phi4_mini": longrope(24, original=128)}  # RoPE on 24 of 32 dims


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def checkpoint(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp(f"{request.param}_gpu")
    ref = build_checkpoint(folder, request.param,
                           **{**GPU_SHAPE, **GPU_CHANGES.get(request.param, {})})
    return request.param, folder, ref.to("cuda")


def hf_generate(ref, ids, new, **kwargs):
    ids_t = torch.tensor([ids], device="cuda")
    return ref.generate(ids_t, attention_mask=torch.ones_like(ids_t), max_new_tokens=new, do_sample=False,
                        eos_token_id=EOS, pad_token_id=2, **kwargs)


def test_float32_greedy_and_beam_match_transformers_on_the_gpu(checkpoint):
    from deft.model import load_model

    family, folder, ref = checkpoint
    model, tok = load_model(folder, device="cuda", dtype="float32")
    assert model.device.type == "cuda" and model.dtype == torch.float32
    engine = TreeEngine(model, tok, num_pages=64, page_size=16, backend="triton")
    prompts, new = [TINY_PROMPTS[0], TINY_PROMPTS[1]], 8
    for ids, got in zip(prompts, generate(engine, prompts, SamplingParams(max_new_tokens=new))):
        assert got.token_ids == hf_generate(ref, ids, new)[0, len(ids):].tolist(), family
    for ids, hyps in zip(prompts, beam_search(engine, prompts, 3, new, num_return_sequences=2)):
        out = hf_generate(ref, ids, new, num_beams=3, num_return_sequences=2, output_scores=True,
                          return_dict_in_generate=True)
        for j, hyp in enumerate(hyps):
            seq = out.sequences[j, len(ids):].tolist()
            assert hyp.token_ids == seq[:len(hyp.token_ids)], (family, j)


def test_bfloat16_stays_within_rounding(checkpoint):
    from deft.model import load_model

    family, folder, ref = checkpoint
    model, tok = load_model(folder, device="cuda", dtype="bfloat16")
    assert model.dtype == torch.bfloat16
    engine = TreeEngine(model, tok, num_pages=64, page_size=16, backend="triton")
    ids = TINY_PROMPTS[2]
    root = engine.add_prompt([])
    (got,) = engine.extend([(root, ids)], logits="all")
    with torch.no_grad():
        want = ref(torch.tensor([ids], device="cuda")).logits[0].float()
    scale = float(want.abs().max())
    assert float((got.float() - want).abs().max()) / scale < 0.05, family
    assert int(got[-1].argmax()) == int(want[-1].argmax()), family
