"""The K/V pool's flags of non-finite slots (``KVPool(nonfinite_flags=True)``): every write
path keeps them exact, and the engine hands them to attention, whose triton backend then
skips the non-finite checks of work over clean slots without changing any result."""

from __future__ import annotations

import pytest
import torch

from deft.cache import KVPool, KVSpec

FP8 = torch.float8_e4m3fn
# NaN and overflow are the point here: numpy (the Triton interpreter) need not warn about them.
pytestmark = [pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning"),
              pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning"),
              pytest.mark.filterwarnings("ignore:All-NaN slice encountered:RuntimeWarning")]


def rows(n: int, bad: dict[int, float], h: int = 2, d: int = 8, seed: int = 0) -> torch.Tensor:
    x = torch.randn(n, h, d, generator=torch.Generator().manual_seed(seed))
    for i, value in bad.items():
        x[i, i % h, i % d] = value
    return x


@pytest.mark.parametrize("spec", [KVSpec(torch.float32), KVSpec(torch.bfloat16),
                                  KVSpec(FP8, "per_head")], ids=["fp32", "bf16", "fp8"])
def test_pool_flags_follow_writes_and_copies(spec):
    pool = KVPool(2, 4, 4, 2, 8, spec=spec, nonfinite_flags=True)
    assert pool.nonfinite.shape == (2, 16) and not pool.nonfinite.any()
    slots = torch.tensor([3, 0, 9, 12])
    pool.write(0, slots, rows(4, {1: float("inf")}), rows(4, {3: float("nan")}, seed=1))
    pool.write(1, slots, rows(4, {}), rows(4, {2: float("-inf")}, seed=1))
    want = torch.zeros(2, 16, dtype=torch.uint8)
    want[0, [0, 12]] = 1
    want[1, 9] = 1
    assert torch.equal(pool.nonfinite, want)
    assert pool.flags(1).data_ptr() == pool.nonfinite[1].data_ptr()
    pool.copy_slots(torch.tensor([12, 9]), torch.tensor([5, 6]))
    want[:, [5, 6]] = want[:, [12, 9]]
    assert torch.equal(pool.nonfinite, want)
    pool.write(0, torch.tensor([0]), rows(1, {}), rows(1, {}))  # rewritten clean: cleared
    want[0, 0] = 0
    assert torch.equal(pool.nonfinite, want)
    # The flags describe what is stored (FP8 holds no inf: NaN there).
    for slot in (12, 5):
        assert not torch.isfinite(pool.v_slots[0][slot].float()).all()


def test_pools_keep_no_flags_unless_asked():
    pool = KVPool(2, 4, 4, 2, 8)
    assert pool.nonfinite is None and pool.flags(0) is None
    pool.write(0, torch.arange(2), rows(2, {0: float("nan")}), rows(2, {}))
    pool.copy_slots(torch.tensor([0]), torch.tensor([3]))


def test_the_fused_rope_write_sets_the_flags():
    """``rope_write`` (interpreted on CPU, compiled on a GPU) flags the slots whose stored
    K or V row is non-finite, including a K value the rotation overflows, and clears the
    flags of clean rows it writes."""
    pytest.importorskip("triton")
    from deft.model.fused import rope_write

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    n, h, h_kv, d = 5, 4, 2, 16
    qkv = torch.randn(n, h + 2 * h_kv, d, generator=torch.Generator().manual_seed(0))
    qkv[1, h + 1, 3] = float("nan")  # K of row 1
    qkv[3, h + h_kv, 0] = float("inf")  # V of row 3
    qkv[4, h, 0] = qkv[4, h, d // 2] = 3e38  # K of row 4: the rotation overflows fp32
    qkv = qkv.to(dev)
    table = torch.cat([torch.full((8, d // 2), 0.8), torch.full((8, d // 2), 0.6)], 1).to(dev)
    k, v = (torch.zeros(16, h_kv, d, device=dev) for _ in range(2))
    slots = torch.tensor([2, 7, 0, 11, 5], device=dev)
    flags = torch.ones(16, dtype=torch.uint8, device=dev)
    rope_write(qkv, table, torch.arange(n, device=dev), slots, k, v, h, nonfinite=flags)
    want = torch.ones(16, dtype=torch.uint8)
    want[[2, 0]] = 0
    assert torch.equal(flags.cpu(), want)
    bad = ~(torch.isfinite(k).flatten(1).all(1) & torch.isfinite(v).flatten(1).all(1)).cpu()
    assert bad[[7, 11, 5]].all() and not bad[[2, 0]].any()


@pytest.mark.parametrize("fused", [False, True], ids=["plain", "fused"])
def test_the_engine_hands_the_pools_flags_to_attention(monkeypatch, fused):
    """An engine on the triton backend (interpreted on CPU) keeps flags and passes each
    layer's to attention. A request whose K/V are made NaN (marked, as direct writers must)
    becomes NaN; the other request's logits stay bitwise those of a run without poison,
    and of a run without flags (every check on)."""
    pytest.importorskip("triton")
    from deft.attention import TreeAttention
    from deft.engine import TreeEngine
    from deft.ops.triton.backend import TritonBackend
    from strategies_on_device import PROMPT, model, tokenizer

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    passed = []
    run = TreeAttention.run
    monkeypatch.setattr(TreeAttention, "run", lambda self, *a, **kw: (
        passed.append(kw.get("kv_nonfinite")), run(self, *a, **kw))[1])
    net, tok = model(dev, torch.float32, layers=2), tokenizer()
    net.fused_ops = fused
    runs = []
    for flags, poisoned in ((True, False), (True, True), (False, False)):
        monkeypatch.setattr(TritonBackend, "nonfinite_flags", flags)
        engine = TreeEngine(net, tok, num_pages=16, page_size=16, backend="triton",
                            cuda_graphs=False)
        assert (engine.pool.nonfinite is not None) == flags
        a, b = engine.add_prompt(PROMPT[:37]), engine.add_prompt(PROMPT[40:69])
        engine.extend([(a, PROMPT[37:38]), (b, PROMPT[69:70])])
        if flags:
            assert passed[-1] is engine.pool.flags(1)
            assert not engine.pool.nonfinite.any()
        if poisoned:
            slots = torch.as_tensor(engine.cache.slots(a), device=dev)
            for layer in range(engine.pool.num_layers):
                engine.pool.v_slots[layer][slots[1::3]] = float("nan")
                engine.pool.nonfinite[layer][slots[1::3]] = 1
        both = engine.extend([(a, [6]), (b, [6])])
        runs.append(both)
    (clean_a, clean_b), (got_a, got_b), (plain_a, plain_b) = runs
    assert torch.isfinite(clean_a).all() and torch.isfinite(clean_b).all()
    assert torch.isnan(got_a).all() and torch.equal(got_b, clean_b)
    assert torch.equal(plain_a, clean_a) and torch.equal(plain_b, clean_b)
