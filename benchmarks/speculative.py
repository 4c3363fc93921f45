"""Speculative decoding against plain greedy decoding on the same engine (CPU or GPU).

Each workload is decoded greedily with :func:`deft.engine.generate` and with
:func:`deft.engine.speculative_generate` under several draft-tree shapes, runs
alternating, in one process; the outputs must be identical token for token.
"""

from __future__ import annotations

import os
import statistics
import time
from typing import Callable

import torch

from .report import markdown_table, record, write_record

__all__ = ["spec_table", "EDIT_TEXT"]

EDIT_TEXT = (
    "Alice was beginning to get very tired of sitting by her sister on the bank, and of having "
    "nothing to do: once or twice she had peeped into the book her sister was reading, but it had "
    "no pictures or conversations in it, and what is the use of a book, thought Alice, without "
    "pictures or conversations? So she was considering in her own mind (as well as she could, for "
    "the hot day made her feel very sleepy and stupid), whether the pleasure of making a "
    "daisy-chain would be worth the trouble of getting up and picking the daisies, when suddenly "
    "a White Rabbit with pink eyes ran close by her."
)
WORKLOADS = {
    "edit: copy with a replacement":
        f"Copy this paragraph, replacing 'Alice' with 'Mary':\n\n{EDIT_TEXT}",
    "open question": "Explain why the sky is blue.",
}


def spec_table(
    model_path: str | os.PathLike[str] | None = None,
    device: str = "cpu",
    max_new_tokens: int = 160,
    reps: int = 3,
    workloads: str | os.PathLike[str] | None = None,
    progress: Callable[[str], None] | None = None,
    json_path: str | None = None,
) -> str:
    """Markdown table: per workload and method, new tokens, forwards, tokens per forward,
    tokens/s (median of ``reps`` alternating runs), speed-up over greedy, identical output.

    ``workloads``: the recorded-workloads directory, for the Medusa-tree row (skipped if absent).
    ``json_path``: also write the result record there.
    """
    from deft.engine import (NgramDrafter, SamplingParams, TopKShape, TreeEngine, TreeShape,
                             generate, speculative_generate)
    from deft.model import load_model
    from deft.recorded import workloads_dir

    model, tok = load_model(model_path, device=device)
    engine = TreeEngine(model, tok, num_pages=512)
    params = SamplingParams(max_new_tokens=max_new_tokens)
    d = NgramDrafter.default_shape
    shapes = {
        f"prompt lookup, tree k={d.k} depth {d.depth} width {d.width} (default)": d,
        "prompt lookup, chain of 16, no min_score": TopKShape(k=1, depth=16, width=1),
    }
    try:
        medusa = workloads_dir(workloads) / "medusa" / "mc_sim_7b_63.json"
        shapes["prompt lookup, Medusa mc_sim_7b_63 tree"] = TreeShape.from_file(medusa)
    except FileNotFoundError:
        pass
    methods: dict[str, Callable] = {"greedy (generate)": lambda p: generate(engine, [p], params)[0]}
    for name, shape in shapes.items():
        methods[name] = lambda p, s=shape: speculative_generate(engine, [p], params, tree=s)[0]
    rows = []
    for label, text in WORKLOADS.items():
        prompt = tok.apply_chat_template(text)
        times: dict[str, list[float]] = {m: [] for m in methods}
        results = {}
        for rep in range(reps):
            for name, run in methods.items():
                t0 = time.perf_counter()
                results[name] = run(prompt)
                times[name].append(time.perf_counter() - t0)
                if progress is not None:
                    progress(f"{label} / {name}: {times[name][-1]:.2f} s (rep {rep + 1}/{reps})")
        base = results["greedy (generate)"]
        base_s = statistics.median(times["greedy (generate)"])
        for name, res in results.items():
            sec, n, forwards = statistics.median(times[name]), len(res.token_ids), res.stats["steps"]
            rows.append([label, name, n, forwards, n / forwards, n / sec, base_s / sec,
                         "yes" if res.token_ids == base.token_ids else "NO"])
    headers = ["workload", "method", "new tokens", "forwards", "tokens / forward", "tokens/s",
               "x greedy", "same tokens"]
    if json_path:
        write_record(json_path, record(headers, rows, device, model="SmolLM2-135M-Instruct",
                                       threads=torch.get_num_threads(), reps=reps,
                                       max_new_tokens=max_new_tokens))
    return markdown_table(headers, rows)

