"""The fused Triton kernels of the Llama layer (:mod:`deft.model.fused`) against the plain
PyTorch ops they replace: interpreted on CPU (fp32, fp16), compiled on a GPU (also bf16)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")
from deft.model import LlamaConfig, LlamaModel  # noqa: E402
from deft.model import fused  # noqa: E402
from deft.model.llama import RMSNorm  # noqa: E402
from deft.model.rope import apply_rope, rope_table  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if DEV == "cuda" else [])
# One rounding of the dtype apart at most (the fused ops round fewer times, or in another order).
TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


def close(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> None:
    torch.testing.assert_close(got.float(), want.float(), atol=TOL[dtype], rtol=TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", [64, 72])
def test_rms_norm_with_and_without_residual(dtype, hidden):
    torch.manual_seed(hidden)
    x = torch.randn(5, hidden, device=DEV).to(dtype)
    r = torch.randn(5, hidden, device=DEV).to(dtype)
    norm = RMSNorm(hidden, 1e-5).to(DEV, dtype)
    norm.weight.data = torch.randn(hidden, device=DEV).to(dtype)
    out, s = fused.rms_norm(x, norm.weight, norm.eps)
    assert s is x
    close(out, norm(x), dtype)
    out, s = fused.rms_norm(x, norm.weight, norm.eps, residual=r)
    assert torch.equal(s, x + r)  # the residual sum rounds once, like ``x + r``
    close(out, norm(x + r), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
# 24 and Phi-3's 96: blocks padded past the head; rotary 12 of 16 and Phi-4-mini's 96 of 128:
# partial rotary, the rest of each head passed through
@pytest.mark.parametrize("d, rotary", [(16, 16), (24, 24), (96, 96), (16, 12), (128, 96)])
def test_rope_write_rotates_q_and_writes_k_v_to_their_slots(dtype, d, rotary):
    torch.manual_seed(1)
    config = LlamaConfig(vocab_size=8, hidden_size=96, intermediate_size=8, num_layers=1,
                         num_heads=6, num_kv_heads=3, max_position_embeddings=64, head_dim=d,
                         rotary_dim=rotary)
    h, h_kv = 6, 3
    table = rope_table(config, dtype, DEV)
    n = 7
    qkv = torch.randn(n, h + 2 * h_kv, d, device=DEV).to(dtype)
    pos = torch.randint(0, 64, (n,), device=DEV)
    slots = torch.randperm(20, device=DEV)[:n]
    k = torch.full((20, h_kv, d), 7.0, device=DEV, dtype=dtype)
    v = k.clone()
    q = fused.rope_write(qkv, table, pos, slots, k, v, h)
    cos, sin = table[pos].unsqueeze(1).chunk(2, dim=-1)
    want = apply_rope(qkv[:, :h + h_kv].float(), cos.float(), sin.float())
    close(q, want[:, :h], dtype)
    close(k[slots], want[:, h:], dtype)
    assert torch.equal(v[slots], qkv[:, h + h_kv:])
    untouched = torch.ones(20, dtype=torch.bool, device=DEV)
    untouched[slots] = False
    assert bool((k[untouched] == 7).all()) and bool((v[untouched] == 7).all())


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_mul(dtype):
    torch.manual_seed(2)
    gu = torch.randn(3, 2 * 1500, device=DEV).to(dtype)  # two column blocks, the last ragged
    gate, up = gu.chunk(2, dim=-1)
    close(fused.silu_mul(gu), torch.nn.functional.silu(gate) * up, dtype)


def test_the_launch_chain_is_where_pdl_is_unless_switched_off(monkeypatch):
    """The kernels launch with PDL where the device has it (sm_90+: ``has_pdl``), unless
    ``DEFT_MODEL_PDL=0`` at import or ``set_chained(False)``."""
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    monkeypatch.setattr(fused, "has_pdl", lambda device: device.type == "cuda")
    monkeypatch.setattr(fused, "_chain", True)
    assert fused.chained(cuda) and not fused.chained(cpu)
    fused.set_chained(False)
    assert not fused.chained(cuda)
    fused.set_chained(True)
    assert fused.chained(cuda)
    for value, on in (("0", False), ("1", True)):
        monkeypatch.setenv("DEFT_MODEL_PDL", value)
        assert fused._chain_from_env() is on
    monkeypatch.delenv("DEFT_MODEL_PDL")
    assert fused._chain_from_env() is True


@pytest.mark.parametrize("head_dim, rotary, nope", [(16, 16, ()), (24, 24, ()), (16, 12, ()),
                                                    (16, 16, (1,))])  # SmolLM3's NoPE layers
def test_fused_forward_equals_the_plain_forward(head_dim, rotary, nope):
    """A whole model step, every layer through the fused kernels, against the plain ops."""
    from deft import TreeKVCache

    torch.manual_seed(3)
    config = LlamaConfig(vocab_size=40, hidden_size=64, intermediate_size=80, num_layers=2,
                         num_heads=4, num_kv_heads=2, max_position_embeddings=64,
                         head_dim=head_dim, rotary_dim=rotary, nope_layers=nope)
    model = LlamaModel(config).eval().requires_grad_(False).to(DEV)
    cache = TreeKVCache(4, 4)
    root = cache.add_root(0)
    slots = cache.append(root, 6)
    kids = cache.fork(root, 2)
    slots = list(slots) + [int(cache.append(k, 1)[0]) for k in kids]
    queries = [(root, j + 1) for j in range(6)] + kids
    logits = []
    for fused_ops in (True, False):
        model.fused_ops = fused_ops
        pool = model.new_pool(4, 4)
        attn = model.attention(backend="torch")
        attn.plan(cache.layout(queries))
        t = lambda a: torch.tensor(a, dtype=torch.int64, device=DEV)  # noqa: E731
        logits.append(model(t([1, 5, 9, 3, 2, 8, 4, 6]), t([0, 1, 2, 3, 4, 5, 6, 6]), t(slots),
                            attn, pool, t([5, 6, 7])))
    torch.testing.assert_close(logits[0], logits[1], atol=1e-4, rtol=1e-4)
