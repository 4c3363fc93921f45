"""The engine on a GPU (``pytest -m gpu``; skipped without CUDA).

A small random Llama-shaped model (GQA 4, head_dim 32) runs on CUDA with the ``triton``
attention backend and is checked against the ``torch`` backend on the same GPU: logits of a
tree step, greedy generation of a batch, speculative decoding against plain greedy, and
every strategy (generate, sample, beam search, tree search, speculative decoding with
prompt lookup and a draft model, trace replay).
"""

from __future__ import annotations

import pytest
import torch

from deft.engine import NgramDrafter, SamplingParams, TreeEngine, generate, sample, speculative_generate
from strategies_on_device import PROMPT, VOCAB, model, run_strategies, tokenizer, write_trace

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def engines(dtype: torch.dtype, seed: int = 0, layers: int = 3) -> tuple[TreeEngine, TreeEngine]:
    m = model("cuda", dtype, seed, layers)
    return (TreeEngine(m, tokenizer(), num_pages=512, backend="triton"),
            TreeEngine(m, tokenizer(), num_pages=512, backend="torch"))


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


def test_every_strategy_matches_the_torch_backend(tmp_path):
    trace = tmp_path / "trace.json"
    write_trace(trace)
    tri, ref = engines(torch.float32)
    draft_tri, draft_ref = engines(torch.float32, seed=1, layers=1)
    got = run_strategies(tri, draft_tri, PROMPT[:60], trace)
    want = run_strategies(ref, draft_ref, PROMPT[:60], trace)
    assert got == want
    for tree in ("model", "Medusa tree", "top-k tree"):  # greedy speculation = greedy
        assert got[f"speculative {tree}"][0] == got["generate"][0]
    for engine in (tri, draft_tri):
        assert engine.cache.live_nodes == [] and engine.cache.num_free_pages == engine.cache.num_pages


def test_overlapped_steps_equal_steps_that_wait_on_gpu():
    """Graph-replayed steps fed with tokens drawn on the device (the default on CUDA)."""
    m = model("cuda", torch.float32)
    prompts = [PROMPT[:n] for n in (40, 120, 300)]
    plain = TreeEngine(m, tokenizer(), num_pages=512, overlap=False)
    stops = frozenset(generate(plain, prompts, SamplingParams(max_new_tokens=12))[1].token_ids[3:5])
    got = []
    for overlap in (True, False):
        engine = TreeEngine(m, tokenizer(), num_pages=512, overlap=overlap)
        assert engine.graphs is not None and engine.overlap == overlap
        greedy = generate(engine, prompts, SamplingParams(max_new_tokens=12, stop_token_ids=stops))
        sampled = sample(engine, PROMPT[:200], 6, SamplingParams(
            max_new_tokens=10, temperature=1.0, seed=2, stop_token_ids=frozenset()))[0]
        got.append([(r.token_ids, r.stats["finish_reason"]) for r in greedy + sampled])
        assert engine.cache.live_nodes == [] and engine.cache.num_free_pages == 512
    assert got[0] == got[1]
    assert {reason for _, reason in got[0]} == {"stop", "length"}


def test_a_beam_step_waits_for_the_gpu_once():
    """Scoring a beam step synchronises with the GPU only where it copies the top candidates
    back (``torch.cuda.set_sync_debug_mode`` raises at the first synchronising call)."""
    from deft.engine.beams import BeamParams

    engine = engines(torch.float32)[0]
    root = engine.add_prompt(PROMPT[:20])
    search = BeamParams(num_beams=4, max_new_tokens=8, stop_token_ids=frozenset()).search(engine, 20)
    search.start(root, torch.randn(VOCAB, device="cuda"))
    search.running *= 4  # four beams, as after a first step
    search.logits = torch.randn(4, VOCAB, device="cuda")
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        with pytest.raises(RuntimeError, match="synchroniz") as err:
            search._advance()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    last = [f for f in err.traceback if f.path.name == "beams.py"][-1]
    assert "tolist" in str(last.statement)
