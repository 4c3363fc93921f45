"""Graph-replayed engine steps (:mod:`deft.engine.graphs`): padded to a bucket of query
counts, planned into a graph-safe attention's fixed buffers, run from static inputs.

On CPU the padded steps run eagerly through the interpreted triton kernels and are checked
against the model's plain forward with the torch backend; on a GPU (``-m gpu``) the engine
captures and replays them, checked against the same engine without graphs.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from conftest import Letters
from deft import TreeKVCache, TreeLayout
from deft.engine import TreeEngine
from deft.engine import graphs as graphs_mod
from deft.engine.graphs import StepGraphs
from deft.engine.step import Step
from deft.model import LlamaConfig, LlamaModel

pytest.importorskip("triton")

CUDA = torch.cuda.is_available()


def tiny_model(device: str = "cpu", dtype: torch.dtype = torch.float32) -> LlamaModel:
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=48, hidden_size=64, intermediate_size=96, num_layers=2,
                         num_heads=4, num_kv_heads=2, max_position_embeddings=256)
    return LlamaModel(config).eval().requires_grad_(False).to(device, dtype)


def eager_logits(model, cache, pool, queries, ids, pos, slots, rows):
    attn = model.attention(backend="torch")
    attn.plan(cache.layout(queries))
    t = [torch.as_tensor(np.asarray(a), dtype=torch.int64) for a in (ids, pos, slots, rows)]
    return model(*t[:3], attn, pool, t[3])


@pytest.mark.skipif(CUDA, reason="the eager (uncaptured) padded path is the CPU check")
def test_padded_bucket_steps_equal_the_plain_forward(monkeypatch):
    monkeypatch.setattr(graphs_mod, "_MIN_TOKENS", 8)  # small capacities, so steps outgrow them
    model = tiny_model()
    pages, ps = 16, 4
    pool = model.new_pool(pages + 1, ps)
    cache = TreeKVCache(pages, ps)
    graphs = StepGraphs(model, pool, pages * ps, buckets=(1, 2, 4, 8), backend="triton",
                        device="cpu")
    assert not graphs.capture
    rng = np.random.default_rng(0)
    root = cache.add_root(0)
    prompt = rng.integers(0, 48, 6)
    steps = [[(root, prompt)]]
    leaves = None
    built = set()
    for step in range(5):
        if step == 1:
            leaves = cache.fork(root, 3)
        if step:
            steps.append([(leaf, rng.integers(0, 48, 1 + (step == 3 and i == 0)))
                          for i, leaf in enumerate(leaves)])
        queries, ids, pos, slots = [], [], [], []
        for node, toks in steps[-1]:
            base = sum(cache.num_tokens(n) for n in _path(cache, node))
            have = cache.num_tokens(node)
            slots += cache.append(node, len(toks)).tolist()
            queries += [(node, have + j + 1) for j in range(len(toks))]
            ids += list(toks)
            pos += list(range(base, base + len(toks)))
        rows = list(range(len(queries)))
        layout = cache.layout(queries)
        bucket = graphs.plan(layout)
        assert bucket.queries == graphs.bucket(len(queries)) >= len(queries)
        built.add(id(bucket))
        got = graphs.replay(bucket, Step(layout, np.array(ids), np.array(pos), np.array(slots),
                                         np.array(rows)))
        # The torch backend recomputes the same K/V rows, then attends without padding.
        want = eager_logits(model, cache, pool, queries, ids, pos, slots, rows)
        torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)
        assert not torch.isnan(got).any()
    assert len(built) >= 3 and graphs.rebuilds >= 1  # buckets 8 and 4, one rebuilt


def _path(cache, node):
    out = []
    while node >= 0:
        out.append(node)
        node = cache.parent(node)
    return out


def test_padding_gives_a_valid_layout_with_the_extra_queries_on_a_scratch_root():
    layout = TreeLayout([-1, 0, 0], [0, 3, 4, 6], [5, 6, 7, 2, 9, 10], [1, 2, 2], [1, 1, 2])
    padded = graphs_mod._pad(layout, 3, 99)  # built unchecked (trusted_layout)
    TreeLayout(padded.parents, padded.node_kv_indptr, padded.kv_indices, padded.query_nodes,
               padded.query_kv_lens)  # passes the checks
    assert padded.parents.tolist() == [-1, 0, 0, -1]
    assert padded.kv_indices.tolist() == [5, 6, 7, 2, 9, 10, 99]
    assert padded.query_nodes.tolist() == [1, 2, 2, 3, 3, 3]
    assert padded.query_kv_lens.tolist() == [1, 1, 2, 1, 1, 1]


def test_graphs_are_off_without_cuda_and_refused_there():
    model = tiny_model()
    from deft.model import Tokenizer
    from tokenizers import Tokenizer as Backend
    from tokenizers import models

    tok = Tokenizer(Backend(models.WordLevel({f"t{i}": i for i in range(48)}, unk_token="t0")),
                    eos_token_ids=[])
    engine = TreeEngine(model, tok, num_pages=8, backend="torch")
    assert engine.graphs is None and engine.pool.num_pages == 8
    with pytest.raises(ValueError, match="cuda_graphs: needs a CUDA device"):
        TreeEngine(model, tok, num_pages=8, backend="torch", cuda_graphs=True)
    with pytest.raises(ValueError, match="buckets: expected positive"):
        StepGraphs(model, model.new_pool(2, 4), 4, buckets=(0,), backend="triton", device="cpu")


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
def test_engine_replays_graphs_equal_to_eager_steps(monkeypatch):
    from strategies_on_device import PROMPT, model, tokenizer
    from deft.engine import SamplingParams, generate, sample

    monkeypatch.setattr(graphs_mod, "_MIN_TOKENS", 16)  # buckets outgrow their capacity

    m = model("cuda", torch.float32)
    on = TreeEngine(m, tokenizer(), num_pages=512, backend="triton")
    off = TreeEngine(m, tokenizer(), num_pages=512, backend="triton", cuda_graphs=False)
    assert on.graphs is not None and off.graphs is None
    greedy = SamplingParams(max_new_tokens=40, stop_token_ids=frozenset())
    prompts = [PROMPT[:n] for n in (30, 200, 77)]
    got = [r.token_ids for r in generate(on, prompts, greedy)]
    assert got == [r.token_ids for r in generate(off, prompts, greedy)]
    assert on.stats["graph_steps"] >= 39 and off.stats["graph_steps"] == 0
    sampled = SamplingParams(max_new_tokens=30, temperature=0.8, seed=5, stop_token_ids=frozenset())
    a = [[r.token_ids for r in rs] for rs in sample(on, PROMPT[:100], 6, sampled)]
    b = [[r.token_ids for r in rs] for rs in sample(off, PROMPT[:100], 6, sampled)]
    assert a == b
    assert on.graphs.rebuilds >= 1 and on.graphs.captures <= 4 * len(on.graphs.buckets)
    assert on.cache.live_nodes == [] and on.cache.num_free_pages == on.cache.num_pages


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
def test_captures_load_no_kernel(monkeypatch):
    """The warm-up before each capture launches what the capture launches
    (``captured=True``), so no Triton kernel is loaded while a stream captures (a load
    then invalidates the capture). A model of shapes no other test uses (3 query heads per
    KV head, head_dim 64) makes every kernel variant new to the process."""
    from triton import knobs

    from strategies_on_device import PROMPT, VOCAB, tokenizer
    from deft.engine import SamplingParams, generate, sample

    monkeypatch.setattr(graphs_mod, "_MIN_TOKENS", 16)  # rebuilds: more captures
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=384, intermediate_size=512, num_layers=2,
                         num_heads=6, num_kv_heads=2, max_position_embeddings=2048)
    m = LlamaModel(config).eval().requires_grad_(False).to("cuda", torch.bfloat16)
    engine = TreeEngine(m, tokenizer(), num_pages=512, backend="triton")
    loads: list[tuple[str, bool]] = []

    def on_load(module, function, name, metadata_group, hash_) -> None:
        loads.append((name, torch.cuda.is_current_stream_capturing()))

    knobs.runtime.kernel_load_start_hook.add(on_load)
    try:
        generate(engine, [PROMPT[:n] for n in (30, 120)],
                 SamplingParams(max_new_tokens=12, stop_token_ids=frozenset()))
        sample(engine, PROMPT[:90], 5, SamplingParams(max_new_tokens=12, temperature=0.9, seed=1,
                                                     stop_token_ids=frozenset()))
    finally:
        knobs.runtime.kernel_load_start_hook.remove(on_load)
    assert engine.graphs.captures >= 2
    assert any(name == "tree_partial_kernel" for name, _ in loads), loads
    assert [name for name, capturing in loads if capturing] == []


@pytest.mark.skipif(CUDA, reason="sets the interpreter's config")
def test_buckets_switch_to_the_light_build_and_back_as_eagerly(monkeypatch):
    """While a step's tree asks for the light build (the interpreter's config given a capped
    default build and a light one), its bucket plans it into the bucket's light attention,
    and into the default one once trees no longer ask for it: logits as the engine's without
    graphs, which picks the build per plan alike."""
    import dataclasses

    from deft.ops.triton import configs

    key = ("interpreter", 0, 0)
    capped = dataclasses.replace(configs.CONFIGS[key], maxnreg=64)
    model = tiny_model()
    out, used = [], []
    for graphs in (False, True):
        monkeypatch.setitem(configs.CONFIGS, key, dataclasses.replace(capped, light_per_sm=4))
        engine = TreeEngine(model, Letters(48), num_pages=32, page_size=4, backend="triton")
        runner = engine.runner
        if graphs:  # steps of up to 4 queries padded into a bucket (run eagerly on a CPU)
            runner.graphs = StepGraphs(model, runner.pool, 31 * 4, (4,), "triton", "flatten",
                                       runner.device)
        leaves = engine.cache.fork(engine.add_prompt(list(range(3, 30))), 3)
        out.append([engine.extend([(leaf, [1]) for leaf in leaves])])  # with the prompt: eager
        for t in range(4):
            if t == 2:  # no tree asks for the light build from here
                monkeypatch.setitem(configs.CONFIGS, key, capped)
            out[-1].append(engine.extend([(leaf, [2 + t]) for leaf in leaves]))
            if graphs:
                b = runner.graphs._buckets[4]
                used.append((b.use, b.step_attn._prepared.config.maxnreg))
        assert engine.stats["graph_steps"] == (4 if graphs else 0)
    assert used == [("light", None)] * 2 + [("default", 64)] * 2
    for got, want in zip(*out):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
