"""The backend contract (deft.ops.Backend): a toy backend registered from a test runs
through TreeAttention; what breaks the contract is refused with a named error."""

import numpy as np
import pytest
import torch

from conftest import assert_close, assert_lse_close, random_forest, random_qkv
from deft import TreeAttention, backend_names, register_backend
from deft.ops import Backend, Heads, get_backend
from deft.ops import _FACTORIES, _INSTANCES
from deft.ops.reference import reference_attention
from deft.plan import make_plan


class ToyBackend(Backend):
    """Dense attention straight from the layout, recording what the contract hands it."""

    name = "toy"
    dtypes = (torch.float32,)
    default_block_kv = 16

    def __init__(self) -> None:
        self.calls: list[tuple] = []

    def plan(self, layout, plan_kind, block_kv, heads, device, previous=None, kv_dtype=None):
        self.calls.append(("plan", plan_kind, block_kv, heads, device, previous))
        return _Step(make_plan(layout, plan_kind, block_kv), layout)

    def run(self, prepared, q, k_cache, v_cache, sm_scale, *, out=None, lse_out=None,
            want_lse=True, k_scale=None, v_scale=None, captured=False):
        self.calls.append(("run", out, lse_out, want_lse))
        o, lse = reference_attention(q, k_cache, v_cache, prepared.layout, sm_scale)
        return o.float(), (lse.float() if want_lse else None)


class _Step:
    def __init__(self, plan, layout):
        self.plan, self.layout = plan, layout


@pytest.fixture
def toy():
    register_backend("toy", ToyBackend)
    yield get_backend("toy")
    _FACTORIES.pop("toy", None)
    _INSTANCES.pop("toy", None)


def test_toy_backend_runs_through_tree_attention(toy):
    layout = random_forest(np.random.default_rng(0), 12, 30, max_tokens=200)
    q, k, v = random_qkv(layout, 4, 2, 16, torch.float32, seed=1)
    attn = TreeAttention(4, 2, 16, backend="toy", plan_kind="node")
    assert attn.block_kv == 16  # the backend's default
    assert backend_names()[-1] == "toy" and {"torch", "triton"} <= set(backend_names())
    plan = attn.plan(layout)
    assert plan.kind == "node" and plan.num_queries == layout.num_queries
    assert toy.calls[-1][1:5] == ("node", 16, Heads(4, 2, 16), torch.device("cpu"))
    ref_o, ref_lse = reference_attention(q, k, v, layout, 16**-0.5)
    o = attn.run(q, k, v)
    assert toy.calls[-1] == ("run", None, None, False)
    assert_close(o, ref_o, torch.float32, "toy")
    # Without ``writes_out`` the results are copied into the caller's tensors.
    out, lse_out = torch.empty_like(q), torch.empty(q.shape[:2])
    o2, lse2 = attn.run(q, k, v, return_lse=True, out=out, lse_out=lse_out)
    assert o2 is out and lse2 is lse_out and toy.calls[-1] == ("run", None, None, True)
    assert_close(out, ref_o, torch.float32, "toy out")
    assert_lse_close(lse_out, ref_lse, "toy lse")
    # A second plan hands the first plan's prepared value back as ``previous``.
    attn.plan(layout)
    assert isinstance(toy.calls[-1][5], _Step)


def test_toy_backend_dtypes_are_checked(toy):
    layout = random_forest(np.random.default_rng(1), 3, 5, max_tokens=20)
    q, k, v = random_qkv(layout, 2, 1, 16, torch.float16, seed=0)
    attn = TreeAttention(2, 1, 16, backend="toy")
    attn.plan(layout)
    with pytest.raises(TypeError, match="q: expected dtype float32 for backend 'toy'"):
        attn.run(q, k, v)


def test_registering_a_class_that_is_not_a_backend_fails():
    class NotABackend:
        pass

    with pytest.raises(TypeError, match="factory: expected a subclass of deft.ops.Backend"):
        register_backend("broken", NotABackend)
    with pytest.raises(ValueError, match="name: expected a non-empty backend name"):
        register_backend("auto", ToyBackend)
    assert "broken" not in _FACTORIES


def test_a_factory_breaking_the_contract_is_refused_at_first_use():
    class Legacy(Backend):  # the old hook names: no ``heads``/``want_lse`` parameters
        name, dtypes = "legacy", (torch.float32,)

        def plan(self, layout, plan_kind, block_kv, device):
            raise AssertionError("never called")

        def run(self, prepared, q, k_cache, v_cache, sm_scale):
            raise AssertionError("never called")

    class Unnamed(ToyBackend):  # its builds lack the default one
        name, builds = "unnamed", ("fast",)

    register_backend("legacy", Legacy)
    register_backend("duck", lambda: object())
    register_backend("unnamed", Unnamed)
    try:
        with pytest.raises(TypeError, match=r"backend 'legacy': plan\(\) lacks the parameters heads"):
            TreeAttention(2, 1, 16, backend="legacy")
        with pytest.raises(TypeError, match="backend 'duck': expected an instance of deft.ops.Backend"):
            get_backend("duck")
        with pytest.raises(TypeError, match="backend 'unnamed': builds: expected a tuple of names "
                           "starting with 'default', got .'fast',."):
            get_backend("unnamed")
    finally:
        for name in ("legacy", "duck", "unnamed"):
            _FACTORIES.pop(name, None)
            _INSTANCES.pop(name, None)


@pytest.mark.parametrize("name,writes_out,graph_safe", [("torch", False, False),
                                                         ("reference", False, False),
                                                         ("triton", True, True)])
def test_shipped_backends_declare_their_capabilities(name, writes_out, graph_safe):
    if name == "triton":
        pytest.importorskip("triton")
    backend = get_backend(name)
    assert (backend.writes_out, backend.graph_safe) == (writes_out, graph_safe)
