"""Shared test helpers: random forests, dtype tolerances, loud comparisons."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

# Without a GPU, Triton kernels run in its interpreter (set before triton is imported).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from deft import TreeLayout  # noqa: E402
from deft.recorded import workloads_dir  # noqa: E402

# (atol, rtol) of the attention output against the float64 reference, per input dtype.
# fp16/bf16 outputs are rounded to the dtype, so the bound is a few ulps of |o| <= max|v|.
TOL = {
    torch.float32: (2e-5, 2e-5),
    torch.float16: (2e-3, 2e-3),
    torch.bfloat16: (1.6e-2, 1.6e-2),
}
LSE_TOL = (1e-4, 1e-5)  # lse is float32 for every input dtype
# The isolation checks' kernel variants (deft.ops.triton.configs.KernelConfig changes), the
# same on the interpreter's config and on a GPU's: V's checks deferred with every value tested
# at a work item's end and every score by a select (``PER_VALUE``), and with each of the three
# flags sm_90 takes over that (rows checked by sums, -inf scores by an FMA, checks on the
# accumulator, also with V checked) or all of them ("lean-all": sm_90's 16-bit K/V).
PER_VALUE = {"sum_checks": False, "kv8_sum_checks": False, "inf_by_fma": False,
             "acc_checks": False}
CHECK_VARIANTS = {"deferred": {**PER_VALUE, "deferred_v_checks": True},
                  "sums": {**PER_VALUE, "sum_checks": True, "deferred_v_checks": True},
                  "fma": {**PER_VALUE, "inf_by_fma": True},
                  "acc": {**PER_VALUE, "acc_checks": True, "deferred_v_checks": True},
                  "acc-checked": {**PER_VALUE, "acc_checks": True, "deferred_v_checks": False},
                  "lean-all": {"acc_checks": True, "sum_checks": True, "inf_by_fma": True,
                               "deferred_v_checks": True}}


# The masked tiles' kernel variants, over every K/V width (``aligned_mask`` and
# ``ranges_first`` with their ``kv8_`` fields): sm_90 takes both over 16-bit K/V, and over
# one-byte K/V for head_dim 128 below 2,048 rows; the interpreter's config neither.
TAIL_VARIANTS = {name: {"aligned_mask": a, "kv8_aligned_mask": a, "ranges_first": r,
                        "kv8_ranges_first": r}
                 for name, a, r in (("neither", False, False), ("aligned", True, False),
                                    ("ranges", False, True), ("both", True, True))}


class Letters:
    """Characters as token ids modulo ``vocab``: enough for the engine and its strategies
    (encode, decode, no end token)."""

    eos_token_ids: frozenset[int] = frozenset()

    def __init__(self, vocab: int) -> None:
        self.vocab = vocab

    def encode(self, text: str) -> list[int]:
        return [ord(c) % self.vocab for c in text]

    def decode(self, ids, skip_special_tokens: bool = False) -> str:  # noqa: ANN001
        return "".join(chr(97 + i % 26) for i in ids)


def assert_close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype, what: str) -> None:
    """Compare with the dtype's tolerance; on failure the message lists the worst elements."""
    atol, rtol = TOL[dtype]
    torch.testing.assert_close(actual.double(), expected.double(), atol=atol, rtol=rtol,
                               msg=lambda m: f"{what} ({dtype}): {m}")


def assert_lse_close(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    exp = expected.double()
    act = actual.double()
    finite = torch.isfinite(exp)
    assert torch.equal(torch.isneginf(act), torch.isneginf(exp)), f"{what}: -inf pattern differs"
    torch.testing.assert_close(act[finite], exp[finite], atol=LSE_TOL[0], rtol=LSE_TOL[1],
                               msg=lambda m: f"{what} lse: {m}")


def random_forest(rng: np.random.Generator, num_nodes: int, max_len: int, max_tokens: int = 6000,
                  num_roots: int = 1, partial: bool = True, shuffle: bool = True,
                  empty_frac: float = 0.1) -> TreeLayout:
    """A random forest: ``num_roots`` roots, lengths 0..max_len (scaled to fit max_tokens),
    queries on a random subset of nodes (some nodes have several, some none), partial
    query_kv_len, slots shuffled in a larger cache."""
    num_roots = min(num_roots, num_nodes)
    parents = np.full(num_nodes, -1, np.int64)
    for i in range(num_roots, num_nodes):
        parents[i] = rng.integers(0, i)
    lens = rng.integers(0, max_len + 1, num_nodes)
    lens[rng.random(num_nodes) < empty_frac] = 0
    if lens.sum() > max_tokens:
        lens = lens * max_tokens // lens.sum()
    num_q = int(rng.integers(1, max(2, num_nodes + 8)))
    qn = rng.integers(0, num_nodes, num_q)
    if partial:
        qlen = (rng.random(num_q) * (lens[qn] + 1)).astype(np.int64)
        full = rng.random(num_q) < 0.5
        qlen[full] = lens[qn][full]
    else:
        qlen = None
    total = int(lens.sum())
    slots = rng.permutation(total + int(rng.integers(0, 64)))[:total] if shuffle else None
    return TreeLayout.from_node_lengths(parents, lens, qn, qlen, slots=slots)


def random_qkv(layout: TreeLayout, h_q: int, h_kv: int, d: int, dtype: torch.dtype,
               seed: int = 0, device: str = "cpu") -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    num_slots = int(layout.kv_indices.max(initial=-1)) + 1
    q = torch.randn(layout.num_queries, h_q, d, generator=g)
    k = torch.randn(max(num_slots, 1), h_kv, d, generator=g)
    v = torch.randn(max(num_slots, 1), h_kv, d, generator=g)
    return tuple(t.to(dtype=dtype, device=device) for t in (q, k, v))  # type: ignore[return-value]


def prefer_cuts(monkeypatch, node_cut: int) -> list:
    """Plan with the numpy specification, every kernel config cutting flatten tiles at nodes
    of ``node_cut``+ tokens and the launch model made to finish each cut plan sooner (a step
    keeps it where it holds no more partial states); the cut plans made, in a list."""
    import dataclasses

    from deft.ops.triton import configs
    from deft.plan import step

    for key, cfg in list(configs.CONFIGS.items()):
        monkeypatch.setitem(configs.CONFIGS, key, dataclasses.replace(cfg, node_cut=node_cut))
    monkeypatch.setenv("DEFT_FASTPLAN", "0")
    cuts: list = []

    def make_plan(layout, kind, block_kv, node_cut=0):  # noqa: ANN001, ANN202
        plan = plain(layout, kind, block_kv, node_cut)
        if node_cut:
            cuts.append(plan)
        return plan

    plain = step.make_plan
    monkeypatch.setattr(step, "make_plan", make_plan)
    monkeypatch.setattr(step, "modelled_makespan",
                        lambda plan, params: 0 if any(plan is c for c in cuts) else 1)
    return cuts


def to_paged(cache: torch.Tensor, page_size: int) -> torch.Tensor:
    """``[num_slots, H, D]`` → ``[num_pages, page_size, H, D]`` (zero-padded): same slots."""
    pad = (-cache.shape[0]) % page_size
    return torch.cat([cache, cache.new_zeros(pad, *cache.shape[1:])]).view(-1, page_size, *cache.shape[1:])


@pytest.fixture(scope="session")
def workloads():
    try:
        return workloads_dir()
    except FileNotFoundError as exc:
        pytest.skip(str(exc))


# ------------------------------------------------ SmolLM2-135M, loaded once per session


@pytest.fixture(scope="session")
def smol():
    """``(model, tokenizer)`` of the default model (SmolLM2-135M-Instruct GGUF, float32)."""
    pytest.importorskip("gguf")  # the ``model`` extra's, which reads the file
    from deft.model import load_model

    return load_model()


@pytest.fixture(scope="session")
def smol_ref():
    """``transformers``' LlamaForCausalLM from the same GGUF: the reference."""
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("gguf")  # transformers reads the GGUF file with it
    from deft.model.loader import DEFAULT_GGUF, default_model_path

    return transformers.AutoModelForCausalLM.from_pretrained(
        os.path.dirname(default_model_path()), gguf_file=DEFAULT_GGUF, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def prompts(smol):
    """Four short prompts (modules with prompts of their own define this fixture again)."""
    _, tok = smol
    return [tok.encode(f"Item {i}: the colour of the sky at dusk is") for i in range(4)]


# ------------------------------------------------ the stepwise decode loop


def run_batch(batch, limit: int = 500, join=()) -> int:  # noqa: ANN001 - a deft Batch, Requests
    """Step ``batch`` until it is done (at most ``limit`` steps); ``join``: requests added after
    the second step (joining mid-run). Returns the steps taken."""
    steps, join = 0, list(join)
    while batch.step():
        steps += 1
        if join and steps == 2:
            for r in join:
                batch.add(r)
            join = []
        assert steps < limit
    return steps


def pages_on_running_paths(batch) -> int:  # noqa: ANN001 - a deft Batch
    """The server's ``deft_kv_pages_requests`` recounted: the pages of every path from a root
    to a running branch's or search's node."""
    cache = batch.engine.cache
    nodes = [b.node for b in batch.live if b.node is not None and not b.done]
    nodes += [n for r in batch.running if r.search is not None for n in r.search.nodes]
    slots = [cache.path_slots(n) for n in nodes]
    return len(np.unique(np.concatenate(slots) // cache.page_size)) if slots else 0
