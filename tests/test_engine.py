"""The engine on SmolLM2-135M: one forward per step, strategies against transformers and
against our own linear runs, K/V released as branches end, and the errors users see.

Float32 logits of the same sequence computed through different trees agree within
``TREE_ATOL`` (measured ~5e-5: only the attention tiling differs).
"""

from __future__ import annotations

import ast
import json
from pathlib import Path

import numpy as np
import pytest
import torch

from deft.cache import CacheFullError
from strategies_on_device import write_trace
from deft.engine import (Expansion, SamplingParams, TreeEngine, beam_search, generate, load_trace,
                         probabilities, replay_trace, sample, tree_search)

transformers = pytest.importorskip("transformers")

TREE_ATOL = 2e-4
EOS = [0, 2]  # SmolLM2's <|endoftext|> and <|im_end|>, passed to transformers as well


@pytest.fixture
def engine(smol):
    model, tok = smol
    return TreeEngine(model, tok, num_pages=128, page_size=16, backend="torch")


@pytest.fixture(scope="module")
def prompts(smol):
    _, tok = smol
    return [tok.apply_chat_template("Name three colours."), tok.encode("The capital of France is"),
            tok.encode("def fibonacci(n):")]


def linear_logits(engine, ids):
    """All logits of ``ids`` as one fresh root, prefilled in one forward."""
    root = engine.add_prompt([])
    (out,) = engine.extend([(root, ids)], logits="all")
    engine.cache.prune(root)
    return out


def hf_generate(ref, ids, **kwargs):
    return ref.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                        eos_token_id=EOS, pad_token_id=2, **kwargs)


def assert_empty(engine):
    assert engine.cache.live_nodes == [] and engine.cache.num_free_pages == engine.cache.num_pages


# ---------------------------------------------------------------- core


def test_sampling_params_validation():
    assert SamplingParams().greedy and SamplingParams(stop_token_ids=[3, 4]).stop_token_ids == {3, 4}
    for kwargs, field in [({"temperature": -1}, "temperature"), ({"temperature": float("nan")}, "temperature"),
                          ({"top_k": -1}, "top_k"), ({"top_k": 1.5}, "top_k"), ({"top_p": 0}, "top_p"),
                          ({"top_p": 1.5}, "top_p"), ({"seed": "x"}, "seed"),
                          ({"max_new_tokens": 0}, "max_new_tokens"), ({"stop_token_ids": [-1]}, "stop_token_ids"),
                          ({"stop_token_ids": 5}, "stop_token_ids")]:
        with pytest.raises(ValueError, match=field):
            SamplingParams(**kwargs)


def test_prefill_and_decode_share_one_forward(engine, prompts):
    """A prompt's prefill, another request's decode token and a chunked prefill: one forward."""
    a, b, c = prompts
    full_a, full_b, full_c = (linear_logits(engine, x) for x in (a + [42], b, c))
    root_a = engine.add_prompt([])
    engine.extend([(root_a, a)], logits="none")
    root_c = engine.add_prompt([])
    engine.extend([(root_c, c[:3])], logits="none")
    root_b = engine.add_prompt([])
    steps = engine.stats["steps"]
    out_a, out_b, out_c = engine.extend([(root_a, [42]), (root_b, b), (root_c, c[3:])],
                                        logits=["last", "all", "last"])
    assert engine.stats["steps"] == steps + 1
    assert out_a.shape == (engine.vocab_size,) and out_b.shape == (len(b), engine.vocab_size)
    torch.testing.assert_close(out_a, full_a[-1], atol=TREE_ATOL, rtol=0)
    torch.testing.assert_close(out_b, full_b, atol=TREE_ATOL, rtol=0)
    torch.testing.assert_close(out_c, full_c[-1], atol=TREE_ATOL, rtol=0)
    assert [engine.position(r) for r in (root_a, root_b, root_c)] == [len(a) + 1, len(b), len(c)]


def test_one_token_items_staged_as_one_feed_return_what_one_feed_each_does(smol, prompts,
                                                                          monkeypatch):
    """Runs of one-token items that want their last logits share a feed; mixed with longer
    items, other modes and a draft tree, each item still gets exactly its own result, in
    order, as when every item is a feed of its own (the same step either way)."""
    model, tok = smol
    got, runs = [], []
    for grouped in (True, False):
        engine = TreeEngine(model, tok, num_pages=64, page_size=16, backend="torch")
        if grouped:
            stage = engine._stage_tokens
            monkeypatch.setattr(engine, "_stage_tokens",
                                lambda items, f=stage: runs.append(len(items)) or f(items))
        else:
            def one_each(checked, modes, sources, e=engine):
                for item, mode, src in zip(checked, modes, sources):
                    e._stage(*item, mode, src)
                return [0] * len(checked)
            monkeypatch.setattr(engine, "_stage_items", one_each)
        root = engine.add_prompt(prompts[1][:-1])
        engine.extend([(root, prompts[1][-1:])])
        leaves = engine.cache.fork(root, 6)
        steps, runs[:] = engine.stats["steps"], []
        rows, trees = engine.forward(
            [(leaves[0], [5]), (leaves[1], [6]), (leaves[2], [7, 8]), (leaves[3], [9]),
             (leaves[4], [10]), (leaves[0], [11])],
            [(leaves[5], [-1, 0], [12, 13])], ["last", "last", "all", "none", "last", "last"])
        assert engine.stats["steps"] == steps + 1
        got.append((rows, trees, list(runs)))
    (a, ta, runs_a), (b, tb, runs_b) = got
    assert runs_a == [2, 2] and runs_b == []  # items 0 and 1, then 4 and 5
    vocab = engine.vocab_size
    assert [r.shape for r in a] == [r.shape for r in b] == [
        (vocab,), (vocab,), (2, vocab), (0, vocab), (vocab,), (vocab,)]
    assert all(torch.equal(x, y) for x, y in zip(a, b))
    assert ta[0][0] == tb[0][0] and torch.equal(ta[0][1], tb[0][1])


def test_add_prompt_prefills_with_the_next_forward(engine, prompts):
    """A root from add_prompt can be forked at once; its K/V come with the next extend."""
    ids = prompts[0]
    expected = linear_logits(engine, ids + [7])
    root = engine.add_prompt(ids[:-1])
    left, right = engine.cache.fork(root, 2)
    got_left, got_right = engine.extend([(left, ids[-1:]), (right, ids[-1:] + [7])])
    torch.testing.assert_close(got_left, expected[-2], atol=TREE_ATOL, rtol=0)
    torch.testing.assert_close(got_right, expected[-1], atol=TREE_ATOL, rtol=0)
    assert engine.stats["logit_rows"] == len(ids) + 1 + 2  # the linear run, then two rows
    dropped = engine.add_prompt(ids)  # queued, then pruned: never computed
    engine.cache.prune(dropped)
    (again,) = engine.extend([(right, [7])])
    torch.testing.assert_close(again, linear_logits(engine, ids + [7, 7])[-1], atol=TREE_ATOL, rtol=0)


def test_extend_tree_matches_linear_paths(engine, prompts):
    ids = prompts[1]
    root = engine.add_prompt(ids[:-1])
    (leaf,) = engine.cache.fork(root, 1)
    engine.extend([(leaf, ids[-1:])], logits="none")
    parents, tokens = [-1, -1, 0, 0, 2], [11, 22, 33, 44, 55]
    ids_tree, logits = engine.extend_tree(leaf, parents, tokens)
    assert logits.shape == (5, engine.vocab_size) and len(ids_tree) == 5
    for i, path in enumerate([[11], [22], [11, 33], [11, 44], [11, 33, 55]]):
        torch.testing.assert_close(logits[i], linear_logits(engine, ids + path)[-1], atol=TREE_ATOL, rtol=0)
    assert engine.position(ids_tree[4]) == len(ids) + 3
    engine.cache.commit_path(leaf, [ids_tree[0], ids_tree[2]])
    (nxt,) = engine.extend([(leaf, [99])])
    torch.testing.assert_close(nxt, linear_logits(engine, ids + [11, 33, 99])[-1], atol=TREE_ATOL, rtol=0)
    (a, _), (b, lb) = engine.extend_trees([(leaf, [-1], [1]), (root, [-1, 0], [5, 6])])
    torch.testing.assert_close(lb[1], linear_logits(engine, ids[:-1] + [5, 6])[-1], atol=TREE_ATOL, rtol=0)


def test_engine_errors_change_nothing(smol, prompts):
    model, tok = smol
    engine = TreeEngine(model, tok, num_pages=4, page_size=16)
    root = engine.add_prompt([])
    kid = engine.cache.fork(root, 1)[0]
    with pytest.raises(ValueError, match=r"items\[0\]: node .* has children"):
        engine.extend([(root, [1])])
    with pytest.raises(ValueError, match=r"items\[0\].*pruned|never created"):
        engine.extend([(12345, [1])])
    with pytest.raises(ValueError, match=r"items\[1\]: token id 49152 .* outside the vocabulary"):
        engine.extend([(kid, [1]), (kid, [49152])])
    with pytest.raises(TypeError, match=r"items\[0\].*encode text"):
        engine.extend([(kid, "hello")])
    with pytest.raises(ValueError, match=r"logits: expected one of"):
        engine.extend([(kid, [1])], logits="first")
    with pytest.raises(CacheFullError, match="needed 7 free pages, 4 free"):
        engine.extend([(kid, [1] * 100)])
    with pytest.raises(ValueError, match="token_ids: the prompt has 8193 tokens"):
        engine.add_prompt([1] * 8193)
    with pytest.raises(ValueError, match=r"trees\[0\] parents\[1\]: expected -1 or an earlier"):
        engine.extend_tree(kid, [-1, 1], [3, 4])
    with pytest.raises(ValueError, match="device: expected the model's device"):
        TreeEngine(model, tok, device="meta")
    assert engine.cache.num_tokens(kid) == 0 and engine.cache.num_free_pages == 4 and engine.stats["steps"] == 0
    big = TreeEngine(model, tok, num_pages=600, page_size=16)
    long_root = big.add_prompt([5] * 8190)  # staged, never computed: pruned first
    with pytest.raises(ValueError, match=r"items\[0\]: node .* would reach 8193 tokens, more than the model's context of 8192"):
        big.extend([(long_root, [1, 2, 3])])
    big.cache.prune(long_root)
    assert big.extend([]) == [] and big.stats["steps"] == 0


def test_probabilities_match_transformers_warpers():
    from transformers.generation.logits_process import (TemperatureLogitsWarper, TopKLogitsWarper,
                                                        TopPLogitsWarper)

    logits = torch.randn(4, 300, generator=torch.Generator().manual_seed(0)) * 3
    for t, k, p in [(0.7, 0, 1.0), (1.0, 20, 1.0), (1.3, 0, 0.8), (0.9, 50, 0.6), (1.0, 1, 1.0)]:
        x = TemperatureLogitsWarper(t)(None, logits.clone())
        if k:
            x = TopKLogitsWarper(k)(None, x)
        if p < 1:
            x = TopPLogitsWarper(p)(None, x)
        got = probabilities(logits, SamplingParams(temperature=t, top_k=k, top_p=p))
        torch.testing.assert_close(got, torch.softmax(x, -1), atol=1e-6, rtol=1e-5)
    one_hot = probabilities(logits, SamplingParams())
    assert torch.equal(one_hot.argmax(-1), logits.argmax(-1)) and torch.equal(one_hot.sum(-1), torch.ones(4))


# ---------------------------------------------------------------- strategies


def test_generate_matches_transformers_greedy(engine, smol_ref, prompts):
    params = SamplingParams(max_new_tokens=10)
    results = generate(engine, prompts, params)
    assert_empty(engine)
    for ids, res in zip(prompts, results):
        ref = hf_generate(smol_ref, ids, max_new_tokens=10, do_sample=False)[0, len(ids):].tolist()
        assert res.token_ids == ref[:len(res.token_ids)], (res.text, engine.tokenizer.decode(ref))
        assert res.stats["finish_reason"] in ("stop", "length") and res.score < 0
    # One request at a time: later prompts are prefilled alongside earlier ones' decoding.
    steps = engine.stats["steps"]
    again = generate(engine, prompts, params, max_batch=2)
    assert [r.token_ids for r in again] == [r.token_ids for r in results]
    assert engine.stats["steps"] - steps < 3 * 10
    assert_empty(engine)


def test_shared_prefix_and_chunked_prefill(smol):
    """Chat prompts share the system prompt's node; prompts are fed 8 tokens per forward."""
    model, tok = smol
    chats = [tok.apply_chat_template(q) for q in ("Hi!", "Name a fruit.", "What is 2+2?")]
    common = next(j for j in range(len(chats[0])) if len({c[j] for c in chats}) > 1)
    engine = TreeEngine(model, tok, num_pages=64, prefill_chunk=8)
    shapes = []

    def watch(_):
        roots = [n for n in engine.cache.live_nodes if engine.cache.parent(n) < 0]
        shapes.append([(engine.cache.num_tokens(r), len(engine.cache.children(r))) for r in roots])

    params = SamplingParams(max_new_tokens=6)
    shared = generate(engine, chats, params, progress=watch)
    assert shapes[0] == [(common, 3)]  # one prompt node, fed once, three forks
    assert engine.stats["steps"] == -(-common // 8) + -(-(max(map(len, chats)) - common) // 8) + 5
    alone = [generate(TreeEngine(model, tok, num_pages=64), [c], params)[0] for c in chats]
    assert [r.token_ids for r in shared] == [r.token_ids for r in alone]
    assert_empty(engine)
    with pytest.raises(ValueError, match="prefill_chunk: expected an integer >= 1"):
        TreeEngine(model, tok, prefill_chunk=0)


def test_prompt_larger_than_the_whole_pool(smol):
    """Pruning cannot help a request larger than the whole pool: the error says so."""
    engine = TreeEngine(*smol, num_pages=2, page_size=16)
    with pytest.raises(CacheFullError, match="needed 3 free pages, 2 free; the whole pool has 2 pages") as err:
        engine.add_prompt(list(range(1, 41)))
    assert "prune" not in str(err.value)
    with pytest.raises(CacheFullError, match="needed 3 free pages, 2 free; the whole pool has 2 pages"):
        generate(engine, [list(range(1, 41))], SamplingParams(max_new_tokens=2))
    assert_empty(engine)


def test_prompts_as_arrays_and_not_bytes(engine):
    """Token ids as numpy or torch integer arrays work like lists; bytes are not token ids."""
    params = SamplingParams(max_new_tokens=3)
    ids = [1, 504, 3458, 282]
    (ref,) = generate(engine, [ids], params)
    for p in (np.array(ids), np.array(ids, dtype=np.int32), torch.tensor(ids)):
        assert [r.token_ids for r in generate(engine, p, params)] == [ref.token_ids]
        assert [r.token_ids for r in generate(engine, [p, ids], params)] == [ref.token_ids] * 2
    for bad in (b"abc", [ids, bytearray(b"abc")]):
        with pytest.raises(TypeError, match=r"prompts(\[1\])?: expected text or token ids, got byte"):
            generate(engine, bad, params)
    with pytest.raises(TypeError, match=r"prompts\[0\]: expected integers, got dtype float"):
        generate(engine, [np.array([1.0, 2.0])], params)
    assert_empty(engine)


def test_readme_sample_snippet_samples_text(smol):
    """The README's engine snippet: its ``sample(...)`` line gives 8 non-empty samples."""
    readme = (Path(__file__).parent.parent / "README.md").read_text()
    block = readme.split("## Engine", 1)[1].split("```python", 1)[1].split("```", 1)[0]
    (call,) = [n.value for n in ast.parse(block).body if isinstance(n, ast.Expr)
               and isinstance(n.value, ast.Call) and getattr(n.value.func, "id", "") == "sample"]
    model, tok = smol
    env = {"engine": TreeEngine(model, tok), "tok": tok, "sample": sample, "SamplingParams": SamplingParams}
    (samples,) = eval(compile(ast.Expression(call), "README.md", "eval"), env)
    assert len(samples) == 8 and all(s.text.strip() for s in samples), [s.text for s in samples]


def test_strategies_release_the_cache_on_errors(smol, prompts):
    model, tok = smol
    engine = TreeEngine(model, tok, num_pages=4, page_size=16)
    keep = engine.add_prompt([1, 2, 3])  # someone else's tree: left alone
    with pytest.raises(CacheFullError):
        generate(engine, prompts[:1], SamplingParams(max_new_tokens=64))
    with pytest.raises(CacheFullError):
        beam_search(engine, prompts[1], 4, 64)
    assert engine.cache.live_nodes == [keep]

    def expand(t):
        raise RuntimeError("expand failed")

    with pytest.raises(RuntimeError, match="expand failed"):
        tree_search(engine, prompts[1], expand, lambda t: 0.0)
    assert engine.cache.live_nodes == [keep]


def test_generate_stops_and_accepts_text(engine, prompts):
    tok = engine.tokenizer
    (free,) = generate(engine, "The capital of France is", SamplingParams(max_new_tokens=6))
    stop = free.token_ids[2]
    (stopped,) = generate(engine, "The capital of France is",
                          SamplingParams(max_new_tokens=6, stop_token_ids={stop}))
    assert stopped.token_ids == free.token_ids[:3] and stopped.stats["finish_reason"] == "stop"
    assert stopped.text == tok.decode(stopped.token_ids, skip_special_tokens=True)
    with pytest.raises(ValueError, match=r"prompts\[1\]: expected text or a non-empty list"):
        generate(engine, ["hi", []])
    with pytest.raises(ValueError, match=r"prompts\[0\]: the prompt has 9000 tokens"):
        generate(engine, [[1] * 9000])
    with pytest.raises(ValueError, match="max_batch"):
        generate(engine, "hi", max_batch=0)


def test_sample_branches_share_the_prompt(engine, prompts):
    ids = prompts[0]
    params = SamplingParams(temperature=0.9, top_p=0.95, seed=5, max_new_tokens=8)
    seen = []

    def watch(_):  # after every sampling step: the prompt is one node with n live branches
        roots = [n for n in engine.cache.live_nodes if engine.cache.parent(n) < 0]
        seen.append((len(roots), [engine.cache.num_tokens(r) for r in roots],
                     len(engine.cache.children(roots[0])) if roots else 0))

    (runs,) = sample(engine, [ids], 4, params, progress=watch)
    assert len(runs) == 4 and len({tuple(r.token_ids) for r in runs}) > 1
    assert seen[0] == (1, [len(ids)], 4)  # branches are forks of the prefilled prompt: no copy
    assert all(s[0] <= 1 for s in seen)
    assert_empty(engine)
    (again,) = sample(engine, ids, 4, params)
    assert [r.token_ids for r in again] == [r.token_ids for r in runs]  # seeded
    (greedy,) = generate(engine, ids, SamplingParams(max_new_tokens=8))
    (top1,) = sample(engine, ids, 2, SamplingParams(temperature=1.0, top_k=1, max_new_tokens=8))
    assert all(r.token_ids == greedy.token_ids for r in top1)
    with pytest.raises(ValueError, match="n: expected an integer >= 1"):
        sample(engine, ids, 0)


@pytest.mark.parametrize("k, length_penalty, early_stopping", [(3, 1.0, False), (4, 0.5, True)])
def test_beam_search_matches_transformers(engine, smol_ref, prompts, k, length_penalty, early_stopping):
    new = 10
    live_leaves = []

    def watch(_):
        live_leaves.append(sum(1 for n in engine.cache.live_nodes if not engine.cache.children(n)))

    results = beam_search(engine, prompts, k, new, length_penalty, early_stopping,
                          num_return_sequences=2, progress=watch)
    assert_empty(engine)
    assert max(live_leaves) <= k * len(prompts)  # pruned beams released at once
    for ids, hyps in zip(prompts, results):
        ref = hf_generate(smol_ref, ids, max_new_tokens=new, num_beams=k, do_sample=False,
                          length_penalty=length_penalty, early_stopping=early_stopping,
                          num_return_sequences=2, output_scores=True, return_dict_in_generate=True)
        for j, hyp in enumerate(hyps):
            seq = ref.sequences[j, len(ids):].tolist()
            assert hyp.token_ids == seq[:len(hyp.token_ids)], (hyp.text, engine.tokenizer.decode(seq))
            assert all(t == 2 for t in seq[len(hyp.token_ids):])  # transformers' padding
            assert hyp.score == pytest.approx(float(ref.sequences_scores[j]), abs=1e-3)


def test_beam_search_errors(engine):
    for kwargs, match in [({"num_beams": 0}, "num_beams"), ({"num_beams": 2, "num_return_sequences": 3},
                          "num_return_sequences: expected at most num_beams=2"),
                          ({"num_beams": 2, "early_stopping": "sometimes"}, "early_stopping"),
                          ({"num_beams": 2, "length_penalty": float("inf")}, "length_penalty"),
                          ({"num_beams": 2, "length_penalty": 1000},  # 6 ** 1000 overflowed
                           r"length_penalty: expected a number in \[-32, 32\], got 1000"),
                          ({"num_beams": 2, "length_penalty": -32.5}, "length_penalty"),
                          ({"num_beams": 2, "max_new_tokens": 0}, "max_new_tokens"),
                          ({"num_beams": 2, "stop_token_ids": ["x"]}, "stop_token_ids")]:
        with pytest.raises(ValueError, match=match):
            beam_search(engine, "hi", **kwargs)


def test_the_cli_caps_the_length_penalty_as_the_engine_does():
    """The CLI keeps its own copy of the cap (it starts without importing the engine)."""
    from deft.cli import generate
    from deft.engine.beams import MAX_LENGTH_PENALTY

    assert generate.MAX_LENGTH_PENALTY == MAX_LENGTH_PENALTY


def test_tree_search_expands_scores_and_releases(engine, prompts):
    tok = engine.tokenizer
    step = tok.encode(" Next:")
    greedy = SamplingParams(max_new_tokens=4)
    leaves_at_expand = []

    def expand(t):
        leaves_at_expand.append(sum(1 for n in engine.cache.live_nodes if not engine.cache.children(n)))
        return [Expansion(prefix=step, params=greedy), Expansion(params=greedy), [tok.encode(" A")[0]]]

    def score(t):  # prefer generated thoughts, then longer ones
        return (t.finish_reason != "prefix") + len(t.path_token_ids()) / 100

    best = tree_search(engine, prompts[1], expand, score, beam_width=2, max_depth=3)
    assert_empty(engine)
    assert leaves_at_expand == [1, 2, 2, 2, 2]  # the prompt, then 2 kept thoughts per depth
    assert len(best) == 2 and all(t.depth == 3 for t in best) and best[0].score >= best[1].score
    # A generated thought is what greedy decoding gives after the prompt and its path.
    t = best[0]
    prefix = prompts[1] + t.parent.path_token_ids()
    (ref,) = generate(engine, [prefix + (step if t.token_ids[:len(step)] == step else [])], greedy)
    assert t.token_ids[-len(ref.token_ids):] == ref.token_ids

    finals = tree_search(engine, prompts[1], expand, score, beam_width=2, max_depth=3,
                         is_final=lambda t: t.finish_reason == "prefix")
    solved = [t for t in finals if t.finish_reason == "prefix"]
    assert sorted(t.depth for t in solved) == [1, 2, 2, 3, 3] and len(finals) == 5 + 2
    assert [t.score for t in finals] == sorted((t.score for t in finals), reverse=True)
    assert_empty(engine)
    with pytest.raises(ValueError, match="Expansion: expected a prefix, params, or both"):
        Expansion()


# ---------------------------------------------------------------- trace replay


@pytest.mark.parametrize("tokens", ["random", "greedy"])
def test_replay_trace(engine, tmp_path, tokens):
    path = tmp_path / "tiny.json"
    write_trace(path)
    report = replay_trace(engine, path, record=0, tokens=tokens)
    assert_empty(engine)
    assert (report.iterations, report.prompt_tokens, report.thoughts, report.max_active) == (9, 40, 5, 3)
    assert report.decode_tokens == 5 + 3 + 8 + 4 + 2
    assert report.kv_bytes_per_branch > report.kv_bytes_deft > 0 and report.tokens_per_s > 0
    assert not engine.count_io
    short = replay_trace(engine, path, max_iterations=4)
    assert short.decode_tokens == 3 * 3 + 2 and short.iterations == 4
    uncounted = replay_trace(engine, path, tokens=tokens, count_io=False)
    assert uncounted.decode_tokens == report.decode_tokens
    assert uncounted.kv_bytes_deft == uncounted.kv_bytes_per_branch == 0
    assert_empty(engine)


def test_trace_errors(tmp_path, workloads):
    assert len(load_trace(workloads / "deft" / "reasoning" / "keywordToT.json", 0)) == 61
    with pytest.raises(ValueError, match=r"record: expected an index in \[0, 98\)"):
        load_trace(workloads / "deft" / "reasoning" / "keywordToT.json", 98)
    bad = tmp_path / "bad.json"
    bad.write_text("{}")
    with pytest.raises(ValueError, match="not a reasoning trace"):
        load_trace(bad)
    with pytest.raises(FileNotFoundError, match="no such trace file"):
        load_trace(tmp_path / "none.json")


_THOUGHTS = {"0": {"value": 12, "start": -11, "end": 0, "children": [1, 2]},
             "1": {"value": 3, "start": 1, "end": 3, "children": [3]},
             "2": {"value": 2, "start": 1, "end": 2, "children": []},
             "3": {"value": 1, "start": 4, "end": 4, "children": []}}


def _edit(node: str, **fields) -> dict:
    return {**_THOUGHTS, node: {**_THOUGHTS[node], **fields}}


@pytest.mark.parametrize("data,message", [
    ({"x": _THOUGHTS["0"]}, "not an object keyed by thought ids"),
    ({k: v for k, v in _THOUGHTS.items() if k != "0"}, "no thought 0"),
    ({**_THOUGHTS, "2": {"value": 2}}, "thought 2: expected an object with value, start, end"),
    (_edit("3", end=4.5), "thought 3: end is not an integer: 4.5"),
    (_edit("1", value=None), "thought 1: value is not an integer"),
    (_edit("0", value=0), "thought 0: a prompt of 0 tokens"),
    (_edit("2", start=0), r"thought 2: start 0, end 2 \(expected 1 <= start <= end \+ 1\)"),
    (_edit("2", start=5), "thought 2: start 5, end 2"),
    (_edit("1", children="3"), "thought 1: children is not a list"),
    (_edit("1", children=[3, 7]), "thought 1: child 7 is not a thought"),
    (_edit("3", children=[0]), "thought 3: child 0 is not a thought"),
    (_edit("2", children=[3], end=3), "thought 3 is a child of both 1 and 2"),
    (_edit("1", children=[]), "thought 3: no thought lists it as a child"),
    (_edit("3", start=3, end=4), "thought 3 starts at 3, before its parent 1 has ended"),
    (_edit("3", children=[3]), "thought 3 is a child of both 1 and 3"),
], ids=lambda x: x if isinstance(x, str) else "")
def test_a_malformed_trace_is_a_value_error_naming_its_thought(tmp_path, data, message):
    """Every rule the replay relies on is checked when the trace is read, not halfway
    through a replay (a KeyError, or a prompt of 10**12 random tokens)."""
    path = tmp_path / "t.json"
    path.write_text(json.dumps([{"incompleted": False, "prompt": "", "data": _THOUGHTS}]))
    assert len(load_trace(path)) == 4
    path.write_text(json.dumps([{"incompleted": False, "prompt": "", "data": data}]))
    with pytest.raises(ValueError, match=message):
        load_trace(path)


def test_a_prompt_past_the_context_is_refused_before_it_is_drawn(engine, tmp_path):
    path = tmp_path / "t.json"
    data = _edit("0", value=10**12)
    path.write_text(json.dumps([{"incompleted": False, "prompt": "", "data": data}]))
    with pytest.raises(ValueError, match=f"a prompt of {10**12} tokens, more than the model's "
                                         f"context of {engine.max_positions}"):
        replay_trace(engine, path)
    assert_empty(engine)
