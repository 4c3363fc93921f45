"""One rank of the tensor-parallel checks, launched by tests/test_tensor_parallel.py under
``torchrun --standalone`` over gloo.

Every rank loads its shard of the model at ``$DEFT_TP_MODEL`` (``default``: SmolLM2) and
builds a ``TreeEngine`` with the group; ranks other than 0 follow. Rank 0 also loads the
whole model into a single-process engine and checks, against it: the logits of a forest
step, greedy, beam search, speculative decoding and seeded sampling tokens. It writes its
summary to ``rank<N>`` under ``$DEFT_TP_OUT`` and exits 1 on a mismatch.

``$DEFT_TP_FAULT``: ``hang`` or ``die`` makes rank 1 hang (sleep) or exit after 3 steps, to
check that the job ends with a clear error within the collective timeout.
``$DEFT_TP_DEVICE=cuda``: each rank on its GPU over NCCL, with the triton backend and CUDA
graphs; rank 0 also replays a CUDA graph that captured an NCCL all-reduce.
"""

import json
import os
import sys
import time

import torch

from deft.distributed import init_tensor_parallel
from deft.engine import (SamplingParams, TreeEngine, beam_search, generate, sample,
                         speculative_generate)
from deft.model import load_model

PROMPTS = [[5, 77, 260, 3, 41, 9, 9, 30], list(range(10, 60, 3)), [7, 8, 9, 7, 8, 9, 7, 8]]
DEVICE = os.environ.get("DEFT_TP_DEVICE", "cpu")
OPTIONS = dict(num_pages=64, page_size=8, backend="torch" if DEVICE == "cpu" else "auto")


def tokens(results) -> list:
    return [[r.token_ids for r in group] if isinstance(group, list) else group.token_ids
            for group in results]


def runs(engine: TreeEngine) -> dict:
    """What rank 0 compares: logits of one forest step, then each strategy's tokens."""
    roots = [engine.add_prompt(p[:-1]) for p in PROMPTS]
    logits = torch.stack(engine.extend([(r, p[-1:]) for r, p in zip(roots, PROMPTS)]))
    for r in roots:
        engine.cache.prune(r)
    greedy = SamplingParams(max_new_tokens=10)
    return {
        "logits": logits,
        "greedy": tokens(generate(engine, PROMPTS, greedy)),
        "beam": tokens(beam_search(engine, PROMPTS[:2], 3, max_new_tokens=6,
                                   num_return_sequences=3)),
        "speculative": tokens(speculative_generate(engine, PROMPTS, greedy)),
        "sampled": tokens(sample(engine, PROMPTS[:2], 3, SamplingParams(
            temperature=1.0, top_k=20, seed=11, max_new_tokens=6))),
    }


def fault(engine: TreeEngine, kind: str) -> None:
    """Rank 1 stops answering after 3 steps: ``hang`` sleeps, ``die`` exits."""
    run, count = engine.runner.run, [0]

    def faulty(step):
        count[0] += 1
        if count[0] > 3:
            if kind == "die":
                os._exit(3)
            time.sleep(3600)
        return run(step)

    engine.runner.run = faulty


def captured_all_reduce(tp) -> bool:
    """A CUDA graph holding an NCCL all-reduce replays it: the sum over the ranks."""
    import torch.distributed as dist

    x = torch.ones(1024, device=tp.device)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        dist.all_reduce(x, group=tp.group)  # warm-up outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        dist.all_reduce(x, group=tp.group)
    x.fill_(2.0)
    graph.replay()
    torch.cuda.synchronize()
    return bool((x == 2.0 * tp.world_size).all())


def main() -> int:
    world = int(os.environ["WORLD_SIZE"])
    tp = init_tensor_parallel(world, DEVICE, timeout_s=float(os.environ.get("DEFT_TP_TIMEOUT", 60)))
    path = os.environ["DEFT_TP_MODEL"]
    path = None if path == "default" else path
    model, tok = load_model(path, device=tp.device, tp=tp)
    engine = TreeEngine(model, tok, tp_group=tp, **OPTIONS)
    out = os.path.join(os.environ["DEFT_TP_OUT"], f"rank{tp.rank}")
    kind = os.environ.get("DEFT_TP_FAULT")
    if tp.rank != 0:
        if kind and tp.rank == 1:
            fault(engine, kind)
        steps = engine.follow()
        if DEVICE == "cuda":
            captured_all_reduce(tp)  # a collective: every rank takes part
        tp.close()
        with open(out, "w") as f:
            json.dump({"rank": tp.rank, "followed": steps,
                       "heads": [model.config.num_heads, model.config.num_kv_heads]}, f)
        return 0
    with engine:
        got = runs(engine)
        steps = engine.stats["steps"]
    captured = captured_all_reduce(tp) if DEVICE == "cuda" else None
    tp.close()
    whole, _ = load_model(path, device=tp.device)
    want = runs(TreeEngine(whole, tok, **OPTIONS))
    err = (got["logits"] - want["logits"]).abs().max().item()
    same = {k: got[k] == want[k] for k in ("greedy", "beam", "speculative", "sampled")}
    if captured is not None:
        same["captured_all_reduce"] = captured
    with open(out, "w") as f:
        json.dump({"rank": 0, "steps": steps, "logits_err": err, "same": same,
                   "heads": [model.config.num_heads, model.config.num_kv_heads]}, f)
    if err > 1e-4 or not all(same.values()):
        print(f"rank 0: logits error {err:.2e}, tokens equal: {same}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
