"""Plan uploads (deft.ops.triton.upload): host buffers taken in turns, refilled only after their
last copy ran, so steps planned while the GPU is still busy stay exact."""

import threading

import pytest
import torch

from conftest import assert_close, random_qkv
from deft import TreeAttention
from deft.ops.reference import reference_attention
from benchmarks.trees import few_shot_layout

pytest.importorskip("triton")
from deft.ops.triton import upload  # noqa: E402

CUDA = torch.cuda.is_available()


def test_buffers_taken_in_turns_and_grown():
    host = upload.Staging(torch.device("cpu"))
    assert host.next() is None
    a = host.new(8)
    a[:8] = torch.arange(8, dtype=torch.int32)
    dst = torch.zeros(8, dtype=torch.int32)
    host.upload(dst, 8)
    assert torch.equal(dst, torch.arange(8, dtype=torch.int32))
    assert host.next() is None  # the other turn's buffer is not made yet
    b = host.new(100)
    assert b.numel() == 125 and b.data_ptr() != a.data_ptr()
    assert host.next() is a and host.next() is b  # back and forth
    assert host.new(4) is host.buffers[host.turn] and host.buffers[1 - host.turn] is a


def test_one_staging_per_device():
    cpu = torch.device("cpu")
    assert upload.staging(cpu) is upload.staging(cpu)


def _steps(attn, layouts, busy_cycles=0):
    """Plan and run each layout in turn (behind ``busy_cycles`` of queued GPU sleep); the
    outputs and their references."""
    inputs = [random_qkv(layout, 8, 2, 64, torch.float16, i, device="cuda")
              for i, layout in enumerate(layouts)]
    torch.cuda.synchronize()
    if busy_cycles:
        torch.cuda._sleep(busy_cycles)
    got = []
    for layout, (q, k, v) in zip(layouts, inputs):
        attn.plan(layout)
        got.append(attn.run(q, k, v))
    torch.cuda.synchronize()
    want = [reference_attention(q, k, v, layout, 64**-0.5)[0]
            for layout, (q, k, v) in zip(layouts, inputs)]
    return got, want


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
@pytest.mark.parametrize("runtime", [True, False], ids=["cuda runtime", "tensor copy"])
def test_plans_behind_a_busy_gpu_stay_exact(monkeypatch, runtime):
    """Five plans made while a long sleep kernel holds the GPU: their uploads queue behind
    it, and the third plan's host buffer is the first's, refilled only after that copy."""
    if runtime:
        assert upload._cudart() is not None, "torch's CUDA runtime library did not load"
    else:
        monkeypatch.setattr(upload, "_cudart", lambda: None)
    layouts = [few_shot_layout(400 + 300 * i, 2 + i, 30) for i in range(5)]
    attn = TreeAttention(8, 2, 64, backend="triton", device="cuda")
    got, want = _steps(attn, layouts, busy_cycles=200_000_000)
    for o, ref in zip(got, want):
        assert_close(o.cpu(), ref.cpu(), torch.float16, "planned behind a busy GPU")


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_plans_in_a_new_thread():
    """A thread that has made no CUDA call yet plans and runs exactly."""
    results = []
    thread = threading.Thread(target=lambda: results.append(_steps(
        TreeAttention(8, 2, 64, backend="triton", device="cuda"),
        [few_shot_layout(300, 3, 20), few_shot_layout(900, 4, 20)])))
    thread.start()
    thread.join()
    (got, want), = results
    for o, ref in zip(got, want):
        assert_close(o.cpu(), ref.cpu(), torch.float16, "planned in a new thread")
