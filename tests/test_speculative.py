"""Speculative decoding: tree shapes, drafters, acceptance (exact greedy tokens on SmolLM2,
the target distribution kept by tree rejection sampling), the batch loop and the CLI."""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json

import numpy as np
import pytest
import torch

from benchmarks.speculative import spec_table
from deft.cli import CliError
from deft.cli.common import choose_device
from deft.cli.speculate import add_parser
from deft.engine import (DraftJob, ModelDrafter, NgramDrafter, SamplingParams, TreeEngine, generate,
                         probabilities, speculative_generate)
from deft.engine.draft_trees import Candidates, DraftTree, TopKShape, TreeGrower, TreeShape, as_shape
from deft.engine.strategies import accept_greedy, accept_sampled
from deft.model import LlamaConfig, LlamaModel, Tokenizer
from deft.recorded import load_medusa_choices

# ---------------------------------------------------------------- tree shapes


def test_shape_from_medusa_choices(workloads):
    choices = load_medusa_choices(workloads / "medusa" / "mc_sim_7b_63.json")
    shape = TreeShape.from_choices(choices)
    assert shape.num_drafts == 63 and shape.depth == 4
    # Every draft is the child of its path's prefix, at the rank the path ends with.
    index = {(): 0}
    for path in sorted(map(tuple, choices), key=lambda p: (len(p), p)):
        index[path] = len(index)
        i = index[path]
        assert shape.parents[i] == index[path[:-1]] and shape.ranks[i] == path[-1]
    assert as_shape(workloads / "medusa" / "mc_sim_7b_63.json", TopKShape()) == shape
    apps = TreeShape.from_file(workloads / "deft" / "speculative" / "APPS_tree_size64.json")
    assert apps.num_drafts == 63


@pytest.mark.parametrize("choices, message", [
    ([[0], [1, 0], [0, 0, 0]], r"path \[1, 0\] has no parent path \[1\]"),
    ([[0], []], "non-empty paths"),
    ([["a"]], "lists of integers"),
    ([[0.5]], "lists of integers"),
    ([[True]], "lists of integers"),
    ([[float("inf")]], "lists of integers"),
    ("01", "lists of integers"),
    (None, "lists of integers"),
    ([[[0]]], "lists of integers"),
])
def test_shape_errors(choices, message):
    with pytest.raises(ValueError, match=message):
        TreeShape.from_choices(choices)


def test_shape_constructor_errors():
    with pytest.raises(ValueError, match=r"parents\[2\]"):
        TreeShape((-1, 0, 2), (0, 0, 0))
    with pytest.raises(ValueError, match=r"ranks\[2\]: expected siblings in increasing rank"):
        TreeShape((-1, 0, 0), (0, 1, 0))
    with pytest.raises(ValueError, match="width"):
        TopKShape(width=0)
    with pytest.raises(ValueError, match="min_score"):
        TopKShape(min_score=1.0)
    with pytest.raises(TypeError, match="tree"):
        as_shape(3.5, TopKShape())


def test_full_and_chain_shapes():
    full = TreeShape.full(2, 3)
    assert full.num_drafts == 2 + 4 + 8 and full.depth == 3
    assert TreeShape.chain(4).parents == (-1, 0, 1, 2, 3)


def grow(shape, root, table, max_depth=99):
    """Grow a tree where the candidates after token t are ``table[t]``."""
    g = TreeGrower(shape, root, max_depth)
    while not g.done:
        g.grow([Candidates(*table[g.tree.tokens[n]]) for n, _ in g.frontier()])
    return g.tree


def test_grower_maps_ranks_to_candidates():
    table = {t: ([10 * t + 1, 10 * t + 2, 10 * t + 3], [0.5, 0.3, 0.2]) for t in range(1000)}
    table[1] = ([11], [1.0])  # fewer candidates than the shape wants: rank 1 is dropped
    tree = grow(TreeShape.from_choices([[0], [1], [0, 0], [0, 1], [2], [1, 2]]), 0, table)
    assert tree.tokens == [0, 1, 2, 3, 11, 23]
    assert tree.parents == [-1, 0, 0, 0, 1, 2]
    assert tree.path(5) == [2, 23]
    assert grow(TreeShape.full(2, 3), 5, table, max_depth=1).tokens == [5, 51, 52]


def test_topk_grower_keeps_best_paths_and_sibling_prefixes():
    table = {1: ([2, 3], [0.6, 0.4]), 2: ([4, 5], [0.5, 0.5]), 3: ([6, 7], [0.9, 0.1])}
    tree = grow(TopKShape(k=2, depth=2, width=2), 1, table)
    # Level 2 scores: 4 0.3, 5 0.3, 6 0.36, 7 0.04; guess 5 competes only once 4 is taken.
    assert tree.tokens == [1, 2, 3, 4, 6] and tree.parents == [-1, 0, 0, 1, 2]
    assert tree.children[0] == [1, 2] and tree.depths == [0, 1, 1, 2, 2]
    assert np.allclose(tree.scores, [1, 0.6, 0.4, 0.3, 0.36])
    # Paths scoring below min_score are not drafted.
    assert grow(TopKShape(k=2, depth=2, width=2, min_score=0.35), 1, table).tokens == [1, 2, 3, 6]


# ------------------------------------------------------------------ n-gram drafter


def ngram_tree(tokens, shape, **kw):
    g = TreeGrower(shape, tokens[-1], 99)
    NgramDrafter(**kw).draft([DraftJob(0, tokens, g)], None, torch.Generator())
    return g.tree


def test_ngram_drafter_copies_the_longest_match():
    text = [5, 1, 2, 3, 4, 9, 9, 1, 2, 7, 8]
    # Suffix "1 2" occurs at 1-2 and 7-8 (the latter is the context itself: no next token),
    # so "1 2" is followed by 3 then 4 9 9 1 2 ...
    tree = ngram_tree(text[:9], TreeShape.chain(4))
    assert tree.tokens == [2, 3, 4, 9, 9]
    # Two continuations of "9": "9 9" and "9 1" become siblings (frequency, then recency).
    tree = ngram_tree([9, 9, 1, 3, 9], TopKShape(k=2, depth=2, width=2))
    assert tree.tokens[:3] == [9, 9, 1] or tree.tokens[:3] == [9, 1, 9]
    assert sorted(tree.tokens[1:3]) == [1, 9] and tree.parents[1:3] == [0, 0]
    assert ngram_tree([1, 2, 3], TreeShape.chain(3)).tokens == [3]  # no match: no drafts


def test_ngram_drafter_index_follows_a_growing_sequence():
    d, seq = NgramDrafter(max_ngram=3), [4, 5, 6, 4, 5]
    for new in ([6, 4], [6, 8, 4], [1, 8]):
        g = TreeGrower(TreeShape.chain(2), seq[-1], 99)
        d.draft([DraftJob(7, seq, g)], None, torch.Generator())
        expect = {5: [6, 4], 4: [5, 6], 8: [4, 5]}[seq[-1]]
        assert g.tree.tokens == [seq[-1], *expect], seq
        seq = seq + new
    g = TreeGrower(TreeShape.chain(2), 2, 99)  # a different sequence under the same key
    d.draft([DraftJob(7, [2, 3, 2], g)], None, torch.Generator())
    assert g.tree.tokens == [2, 3, 2]
    with pytest.raises(ValueError, match="min_ngram"):
        NgramDrafter(max_ngram=2, min_ngram=3)


# ------------------------------------------------------------------------ acceptance


def test_accept_greedy_follows_the_argmax():
    tree = DraftTree([7])
    a = tree.add(0, 3, 1.0)
    tree.add(0, 4, 1.0)
    c = tree.add(a, 5, 1.0)
    logits = torch.full((4, 10), -1.0)
    logits[0, 3] = logits[a, 5] = logits[c, 2] = 1.0  # root -> 3 -> 5 -> 2 (bonus)
    logits[2, 8] = 1.0
    assert accept_greedy(tree, logits) == ([a, c], 2)
    logits[0, 3], logits[0, 6] = -1.0, 2.0
    assert accept_greedy(tree, logits) == ([], 6)


class Markov:
    """Target and draft next-token distributions that depend on the last token only."""

    def __init__(self, vocab: int, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        self.p = torch.softmax(torch.randn(vocab, vocab, generator=g, dtype=torch.float64) * 1.5, -1)
        self.q = torch.softmax(torch.randn(vocab, vocab, generator=g, dtype=torch.float64) * 1.5, -1)
        self.q[:, 0] = 0.0  # the draft never proposes token 0: residuals must supply it
        self.q /= self.q.sum(-1, keepdim=True)

    def candidates(self, token: int, want: int, sample: bool, g: torch.Generator) -> Candidates:
        q = self.q[token]
        if not sample:
            top = torch.topk(q, want)
            return Candidates(top.indices.tolist(), top.values.tolist())
        n = min(want, int((q > 0).sum()))
        gumbel = -torch.log(-torch.log(torch.rand(q.shape, generator=g, dtype=torch.float64)))
        drawn = torch.topk(torch.log(q) + gumbel, n).indices.tolist()
        return Candidates(drawn, torch.sort(q, descending=True).values[:n].tolist(), q)

    def generate(self, root: int, n: int, shape, sample: bool, g: torch.Generator, accept) -> tuple:
        out = []
        while len(out) < n:
            grower = TreeGrower(shape, root, 99)
            while not grower.done:
                grower.grow([self.candidates(grower.tree.tokens[node], want, sample, g)
                             for node, want in grower.frontier()])
            tree = grower.tree
            path, bonus = accept(tree, self.p[tree.tokens], g)
            out += [tree.tokens[c] for c in path] + [bonus]
            root = out[-1]
        return tuple(out[:n])

    def exact(self, root: int, n: int) -> dict[tuple, float]:
        v = self.p.shape[0]
        probs = {}
        for seq in itertools.product(range(v), repeat=n):
            pr, last = 1.0, root
            for t in seq:
                pr, last = pr * float(self.p[last, t]), t
            probs[seq] = pr
        return probs


def chi2_pvalue(counts: dict[tuple, int], probs: dict[tuple, float], trials: int) -> float:
    """Pearson's chi-square test of ``counts`` against ``probs`` (cells pooled to >= 5 expected)."""
    cells = sorted(probs, key=probs.get)
    obs, exp, stat, df = 0, 0.0, 0.0, -1
    for cell in cells:
        obs, exp = obs + counts.get(cell, 0), exp + probs[cell] * trials
        if exp >= 5:
            stat, df, obs, exp = stat + (obs - exp) ** 2 / exp, df + 1, 0, 0.0
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64),
                                         torch.tensor(stat / 2, dtype=torch.float64)))


def biased_accept(tree, probs, g):
    """A wrong rule for the power check: the bonus ignores the rejected children."""
    path, _ = accept_sampled(tree, probs, g)
    last = path[-1] if path else 0
    return path, int(torch.multinomial(probs[last], 1, generator=g))


@pytest.mark.parametrize("shape, sample", [
    (TreeShape.from_choices([[0], [1], [0, 0], [0, 1], [1, 0], [0, 0, 0]]), False),
    (TreeShape.from_choices([[0], [1], [0, 0], [0, 1], [1, 0], [0, 0, 0]]), True),
    (TopKShape(k=3, depth=3, width=3), True),
])
def test_tree_rejection_sampling_keeps_the_target_distribution(shape, sample):
    m, trials, n = Markov(vocab=4, seed=1), 4000, 3
    g = torch.Generator().manual_seed(123)
    counts: dict[tuple, int] = {}
    for _ in range(trials):
        seq = m.generate(2, n, shape, sample, g, accept_sampled)
        counts[seq] = counts.get(seq, 0) + 1
    exact = m.exact(2, n)
    tv = 0.5 * sum(abs(counts.get(s, 0) / trials - p) for s, p in exact.items())
    pvalue = chi2_pvalue(counts, exact, trials)
    assert pvalue > 1e-3, f"chi-square p-value {pvalue:.2g} (TV distance {tv:.3f})"
    assert tv < 0.07  # sampling noise over 64 cells at 4,000 trials is ~0.05
    # Power: the same test, on fewer trials, rejects a subtly wrong acceptance rule.
    wrong: dict[tuple, int] = {}
    for _ in range(1000):
        seq = m.generate(2, n, shape, sample, g, biased_accept)
        wrong[seq] = wrong.get(seq, 0) + 1
    assert chi2_pvalue(wrong, exact, 1000) < 1e-6


# ---------------------------------------------------- end to end on a tiny random model

TINY_VOCAB = 6


@pytest.fixture(scope="module")
def tiny_tok():
    from tokenizers import Tokenizer as Backend
    from tokenizers import models

    vocab = {c: i for i, c in enumerate("abcdef"[:TINY_VOCAB])}
    return Tokenizer(Backend(models.WordLevel(vocab, unk_token="a")), eos_token_ids=[])


def tiny_model(seed: int) -> LlamaModel:
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=TINY_VOCAB, hidden_size=32, intermediate_size=64, num_layers=2,
                         num_heads=4, num_kv_heads=2, max_position_embeddings=64)
    return LlamaModel(config).eval().requires_grad_(False)


def plain_logits(engine: TreeEngine, ids: list[int]) -> torch.Tensor:
    """The target's logits after ``ids``, one plain forward."""
    root = engine.add_prompt(ids[:-1])
    logits = engine.extend([(root, ids[-1:])])[0]
    engine.cache.prune(root)
    return logits


@pytest.mark.parametrize("sample", [False, True])
def test_sampled_speculation_keeps_the_target_distribution(tiny_tok, sample):
    """Three tokens from a tiny target with a different tiny draft model, 2,000 sequences
    in one batch: their joint distribution is the target's (chi-square over 216 cells)."""
    target = TreeEngine(tiny_model(0), tiny_tok, num_pages=65536, page_size=1)
    drafter = ModelDrafter(TreeEngine(tiny_model(1), tiny_tok, num_pages=65536, page_size=1),
                           sample=sample)
    params = SamplingParams(temperature=0.8, top_k=5, seed=7, max_new_tokens=3,
                            stop_token_ids=frozenset())
    prompt, trials = [1, 2, 3], 2000
    results = speculative_generate(target, [prompt] * trials, params, drafter,
                                   tree=TreeShape.full(2, 2))
    counts: dict[tuple, int] = {}
    for r in results:
        counts[tuple(r.token_ids)] = counts.get(tuple(r.token_ids), 0) + 1
    prefixes = {(): 1.0}
    for _ in range(3):
        nxt = {}
        for prefix, pr in prefixes.items():
            p = probabilities(plain_logits(target, prompt + list(prefix))[None], params)[0]
            nxt.update({prefix + (t,): pr * float(p[t]) for t in range(TINY_VOCAB)})
        prefixes = nxt
    exact = prefixes
    tv = 0.5 * sum(abs(counts.get(s, 0) / trials - p) for s, p in exact.items())
    pvalue = chi2_pvalue(counts, exact, trials)
    assert pvalue > 1e-3, f"chi-square p-value {pvalue:.2g} (TV distance {tv:.3f})"
    accepted = sum(sum(r.stats["accepted"]) for r in results)
    assert accepted > trials // 2  # the drafts were used, not just the bonus tokens
    assert target.cache.num_free_pages == 65536 == drafter.engine.cache.num_free_pages


# ------------------------------------------------------------- SmolLM2: exact greedy

PARAGRAPH = (
    "Alice was beginning to get very tired of sitting by her sister on the bank, and of having "
    "nothing to do: once or twice she had peeped into the book her sister was reading, but it "
    "had no pictures or conversations in it, and what is the use of a book, thought Alice, "
    "without pictures or conversations?"
)
EDIT = f"Copy this paragraph, replacing 'Alice' with 'Mary':\n\n{PARAGRAPH}"
NEW = 32


@pytest.fixture(scope="module")
def smol(smol):
    """An engine on the session's SmolLM2 (this module's ``smol`` is the engine)."""
    model, tok = smol
    return TreeEngine(model, tok, num_pages=256)


def plain_greedy(engine: TreeEngine, prompts: list[list[int]], n: int) -> list[list[int]]:
    """Greedy decoding of a batch, one token per sequence per forward."""
    roots = [engine.add_prompt(p[:-1]) for p in prompts]
    outs, eos = [[p[-1]] for p in prompts], engine.tokenizer.eos_token_ids
    live = list(range(len(prompts)))
    while live:
        logits = engine.extend([(roots[i], outs[i][-1:]) for i in live])
        for i, lg in zip(live, logits):
            outs[i].append(int(lg.argmax()))
        live = [i for i in live if len(outs[i]) <= n and outs[i][-1] not in eos]
    for r in roots:
        engine.cache.prune(r)
    return [o[1:] for o in outs]


@pytest.fixture(scope="module")
def smol_prompts(smol):
    """Prompts (an edit, code, a chat question) and their plain greedy continuations."""
    tok = smol.tokenizer
    prompts = [tok.apply_chat_template(EDIT), tok.encode("def fibonacci(n):\n"),
               tok.apply_chat_template("What is the capital of France?")]
    return prompts, plain_greedy(smol, prompts, NEW)


def test_greedy_prompt_lookup_equals_plain_greedy(smol, smol_prompts, workloads):
    prompts, expected = smol_prompts
    results = speculative_generate(smol, prompts, max_new_tokens=NEW)  # one batch
    for r, exp in zip(results, expected):
        assert r.token_ids == exp, (smol.tokenizer.decode(r.token_ids), smol.tokenizer.decode(exp))
        st = r.stats
        assert st["steps"] == len(st["accepted"]) and sum(st["accepted"]) + st["steps"] >= len(exp)
        assert r.text == smol.tokenizer.decode(exp, skip_special_tokens=True)
    edit = results[0].stats
    assert edit["tokens_per_step"] >= 3, edit  # the copy is mostly accepted
    assert edit["finish_reason"] == "length" and results[2].stats["finish_reason"] == "stop"
    medusa = workloads / "medusa" / "mc_sim_7b_63.json"
    (single,) = speculative_generate(smol, prompts[0], tree=medusa, max_new_tokens=NEW)
    assert single.token_ids == expected[0]
    assert smol.cache.num_free_pages == 256


def test_limits_and_stop_tokens_inside_accepted_drafts(smol, smol_prompts):
    prompts, expected = smol_prompts
    (short,) = speculative_generate(smol, [prompts[0]], max_new_tokens=5)
    assert short.token_ids == expected[0][:5] and short.stats["finish_reason"] == "length"
    stop = expected[0][9]
    params = SamplingParams(stop_token_ids=frozenset({stop}), max_new_tokens=NEW)
    (stopped,) = speculative_generate(smol, [prompts[0]], params)
    cut = expected[0].index(stop) + 1
    assert stopped.token_ids == expected[0][:cut] and stopped.stats["finish_reason"] == "stop"


def test_model_drafter_greedy_equals_plain_greedy(smol, smol_prompts):
    prompts, expected = smol_prompts
    # The target as its own drafter: every draft on the greedy path is accepted.
    same = ModelDrafter(TreeEngine(smol.model, smol.tokenizer, num_pages=256))
    results = speculative_generate(smol, prompts[1:], drafter=same, tree=TreeShape.full(2, 3),
                                   max_new_tokens=NEW)
    assert [r.token_ids for r in results] == expected[1:]
    # More than 3 tokens per draft tree (the first token comes from the prompt's forward).
    assert all((len(r.token_ids) - 1) / (r.stats["steps"] - 1) > 3 for r in results), [r.stats for r in results]
    # A random draft model: drafts are rejected, the output is unchanged.
    config = dataclasses.replace(smol.model.config, hidden_size=32, intermediate_size=32,
                                 num_layers=1, num_heads=2, num_kv_heads=1, head_dim=16)
    torch.manual_seed(0)
    noise = ModelDrafter(TreeEngine(LlamaModel(config).eval(), smol.tokenizer, num_pages=256))
    (r,) = speculative_generate(smol, prompts[1], drafter=noise, max_new_tokens=12)
    assert r.token_ids == expected[1][:12]
    assert same.engine.cache.num_free_pages == 256 == noise.engine.cache.num_free_pages


@pytest.mark.parametrize("shape", [TreeShape.full(2, 3), TreeShape.full(1, 1)])
def test_a_draft_model_of_a_shorter_context_drafts_within_it(tiny_tok, shape):
    """The target as its own drafter, the draft's context 16 of the target's 64: drafts are
    accepted while the sequence fits the draft model, then each step verifies the root alone;
    the tokens stay the target's greedy ones and no step raises. The chain of one (one token,
    then two a step) reaches exactly 16 tokens, where no draft token fits."""
    target = TreeEngine(tiny_model(0), tiny_tok, num_pages=64, page_size=4)
    short = LlamaModel(dataclasses.replace(target.model.config, max_position_embeddings=16)).eval()
    short.load_state_dict(target.model.state_dict())
    drafter = ModelDrafter(TreeEngine(short, tiny_tok, num_pages=64, page_size=4))
    sent = []  # (context length, draft budget) of every job the drafter was given
    draft = drafter.draft
    drafter.draft = lambda jobs, *a: sent.extend(
        (len(j.tokens), j.grower.max_depth) for j in jobs) or draft(jobs, *a)
    params = SamplingParams(max_new_tokens=40, stop_token_ids=frozenset())
    prompt = [1, 2, 3, 4, 5]
    (r,) = speculative_generate(target, [prompt], params, drafter, tree=shape)
    (want,) = generate(target, [prompt], params)
    assert r.token_ids == want.token_ids and len(r.token_ids) == 40
    accepted = r.stats["accepted"]
    assert sum(accepted[:3]) > 0 and all(a == 0 for a in accepted[-20:]), accepted
    # The draft model is given only sequences it can draft a token for (no forward at 16).
    assert sent and all(n < 16 and depth > 0 for n, depth in sent), sent
    assert drafter.engine.cache.num_free_pages == 64 == target.cache.num_free_pages


def test_errors_name_the_argument(smol, tiny_tok):
    with pytest.raises(TypeError, match="engine"):
        speculative_generate(object(), [[1, 2]])
    with pytest.raises(ValueError, match=r"prompts\[1\]"):
        speculative_generate(smol, [[1, 2], []])
    with pytest.raises(ValueError, match="max_new_tokens"):
        speculative_generate(smol, [[1, 2]], max_new_tokens=0)
    with pytest.raises(ValueError, match="drafter: expected the target's vocabulary"):
        speculative_generate(smol, [[1, 2]], drafter=ModelDrafter(TreeEngine(tiny_model(0), tiny_tok)))
    with pytest.raises(TypeError, match="drafter"):
        speculative_generate(smol, [[1, 2]], drafter="ngram")
    with pytest.raises(ValueError, match="choices"):
        speculative_generate(smol, [[1, 2]], tree=[[1, 0]])
    with pytest.raises(TypeError, match="engine"):
        ModelDrafter(smol.model)
    assert smol.cache.num_free_pages == 256


# ------------------------------------------------------------------------------- CLI


def run_cli(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(prog="deft")
    add_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    choose_device(args)  # as deft's main does
    args.func(args)


def test_cli_json(capsys, smol, smol_prompts, workloads):
    tree = workloads / "deft" / "speculative" / "APPS_tree_size10.json"
    run_cli(["speculate", EDIT, "--chat", "--max-new-tokens", "12", "--tree", str(tree), "--json"])
    (doc,) = json.loads(capsys.readouterr().out)
    assert doc["token_ids"] == smol_prompts[1][0][:12]
    assert doc["text"] == smol.tokenizer.decode(doc["token_ids"], skip_special_tokens=True)
    assert doc["stats"]["steps"] >= 1


@pytest.mark.parametrize("argv, message", [
    (["x", "--drafter", "model"], "--draft-model: expected a path with --drafter model"),
    (["x", "--draft-model", "m.gguf"], "--draft-model"),
    (["x", "--tree", "/no/such.json"], "--tree: no such file"),
    (["x", "--model", "/no/such.gguf"], "/no/such.gguf"),
    (["x", "--max-new-tokens", "0"], "^--max-new-tokens: expected an integer >= 1, got 0"),
    (["x", "--temperature", "-1"], "^--temperature: expected a finite number >= 0"),
    (["x", "--temperature", "1", "--seed", str(2**64)], r"^--seed: expected an integer in \[-9223372036854775808, "),
])
def test_cli_errors(argv, message):
    with pytest.raises(CliError, match=message) as info:
        run_cli(["speculate", *argv])
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("text, message", [
    ('{"paths": [[0], [0.5]]}', r"^--tree: choices: expected a list of lists of integers"),
    ('{"paths": [[1e400]]}', r"^--tree: choices: expected a list of lists of integers"),
    ("{paths", r"^--tree: .*bad\.json: not JSON"),
    ("[[0]]", r"^--tree: .*bad\.json: expected a JSON object with 'Tree_Structure' or 'paths'"),
])
def test_cli_a_malformed_tree_file_is_one_error_line(tmp_path, text, message):
    """Before the model loads: no traceback (``1e400`` is a float infinity), no rank rounded
    from a float."""
    (tmp_path / "bad.json").write_text(text)
    with pytest.raises(CliError, match=message) as info:
        run_cli(["speculate", "x", "--tree", str(tmp_path / "bad.json")])
    assert "\n" not in str(info.value)


def test_cli_non_utf8_prompt(capsys, smol):
    """Undecodable argv bytes (surrogate escapes) become U+FFFD, as in the other commands."""
    run_cli(["speculate", "caf\udce9 \udcff", "--max-new-tokens", "2", "--json"])
    (doc,) = json.loads(capsys.readouterr().out)
    (ref,) = speculative_generate(smol, [smol.tokenizer.encode("caf\ufffd \ufffd")], max_new_tokens=2)
    assert doc["token_ids"] == ref.token_ids


def test_spec_bench_table(workloads):
    table = spec_table(max_new_tokens=6, reps=1, workloads=workloads)
    lines = table.splitlines()
    assert len(lines) == 2 + 2 * 4  # header, rule, 2 workloads x (greedy + 3 trees)
    assert all(line.rstrip(" |").endswith("yes") for line in lines[2:]), table


def test_draft_tree_depths_are_remembered_per_tree_shape(tiny_tok):
    """``_check_tree`` keeps the depths of the last few tree shapes: the positions and the
    checks are those of a fresh walk, whether the shape is remembered or not."""
    engine = TreeEngine(tiny_model(0), tiny_tok, num_pages=16, page_size=4, backend="torch")
    root = engine.add_prompt([1, 2, 3])
    rng = np.random.default_rng(0)
    shapes = [[int(rng.integers(-1, i)) for i in range(m)] for m in rng.integers(1, 12, 20)]
    for parents in shapes + shapes[::-1] + shapes:
        _, _, _, positions = engine._check_tree(0, (root, parents, [1] * len(parents)), {})
        depth: list[int] = []
        for p in parents:
            depth.append(0 if p < 0 else depth[p] + 1)
        assert positions.tolist() == [3 + d for d in depth]
        assert len(engine._tree_depths) <= 8
    chain = list(range(-1, 61))  # 62 drafts after 3 tokens: one past the context of 64
    for _ in range(2):
        with pytest.raises(ValueError, match=r"trees\[0\] parents\[1\]: expected -1 or an earlier"):
            engine._check_tree(0, (root, [-1, 1], [1, 1]), {})
        with pytest.raises(ValueError, match=r"trees\[0\]: node 0 would reach 65 tokens"):
            engine._check_tree(0, (root, chain, [1] * len(chain)), {})
    engine._check_tree(0, (root, chain[:-1], [1] * (len(chain) - 1)), {})
