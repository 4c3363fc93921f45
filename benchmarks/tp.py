"""``deft bench tp``: the engine at each tensor-parallel size, one ``torchrun`` job per size.

Each job runs :mod:`benchmarks.tp_worker` on every rank (gloo on CPU, NCCL on CUDA) and rank
0 reports: sampling tokens/s and decode step time, draft-tree verification time, and the
all-reduce time a step's layers spend (measured apart, synchronised). On CPU the ranks share
the machine's cores, so the table shows the collectives' overhead more than a speed-up.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Callable

from .report import markdown_table, record, write_record

__all__ = ["tp_table"]

HEADERS = ["TP", "device", "dtype", "sampling tok/s", "decode step ms", "all-reduce ms/step",
           "tree verify ms", "all-reduce ms/tree", "speed-up (tok/s)"]


def run_size(size: int, model: str, device: str, prompt_tokens: int, branches: int,
             new_tokens: int, draft_tokens: int, reps: int, num_pages: int,
             timeout: float = 1800) -> dict:
    """Rank 0's row of one ``torchrun --nproc-per-node size`` job."""
    root = Path(__file__).resolve().parents[1]
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "row.json")
        env = {**os.environ, "MASTER_ADDR": "127.0.0.1",
               "PYTHONPATH": os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")])}
        if device == "cpu":
            env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // size)))
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nnodes", "1",
               "--nproc-per-node", str(size), "-m", "benchmarks.tp_worker", "--size", str(size),
               "--model", model, "--device", device, "--prompt-tokens", str(prompt_tokens),
               "--branches", str(branches), "--new-tokens", str(new_tokens),
               "--draft-tokens", str(draft_tokens), "--reps", str(reps),
               "--num-pages", str(num_pages), "--out", out]
        run = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
        if run.returncode != 0 or not os.path.isfile(out):
            raise RuntimeError(f"tensor-parallel size {size} failed (exit {run.returncode}):\n"
                               + (run.stderr or run.stdout)[-3000:])
        with open(out) as f:
            return json.load(f)


def tp_table(sizes: list[int], model: str, device: str, prompt_tokens: int, branches: int,
             new_tokens: int, draft_tokens: int, reps: int, num_pages: int,
             progress: Callable[[str], None] | None = None, json_path: str | None = None) -> str:
    """The markdown table of every size in ``sizes`` (and, with ``json_path``, the record)."""
    rows = []
    for size in sizes:
        if progress:
            progress(f"tensor-parallel size {size}: torchrun --nproc-per-node {size}")
        rows.append(run_size(size, model, device, prompt_tokens, branches, new_tokens,
                             draft_tokens, reps, num_pages))
    base = rows[0]["sampling_tokens_per_s"]
    table = [[r["size"], r["device"], r["dtype"], f"{r['sampling_tokens_per_s']:.1f}",
              f"{r['sampling_decode_step_ms']:.2f}", f"{r['allreduce_ms_per_decode_step']:.3f}",
              f"{r['tree_verify_ms']:.2f}", f"{r['allreduce_ms_per_tree_step']:.3f}",
              f"{r['sampling_tokens_per_s'] / base:.2f}x"] for r in rows]
    title = (f"{model} on {device}: sampling b={branches} from a {prompt_tokens}-token prompt, "
             f"{new_tokens} new tokens each; a {draft_tokens}-token draft tree verified")
    if json_path:
        write_record(json_path, record(HEADERS, table, device, workload=title))
    return f"{title}\n\n{markdown_table(HEADERS, table)}"
