"""``deft bench e2e``: the engine against ``transformers`` ``generate`` on the same machine.

Both run SmolLM2-135M-Instruct loaded from the same GGUF (dequantised to float32) in one
process, on the same prompts with the same stop ids ({0, 2}); runs alternate and the best
of ``reps`` wall-clock times counts (the CPU is shared). Times are end to end: prefill,
every decode step and the decoding policy. A batch is one ``generate`` call for both:
``transformers`` pads on the left, DeFT lays the prompts out as a forest (prompts that
share a prefix share one node) and drops finished sequences at once. Tokens/s counts the
tokens DeFT generates; the table says whether ``transformers`` returned the same tokens.
"""

from __future__ import annotations

import copy
import os
import time
from dataclasses import dataclass
from typing import Any, Callable

import torch

from .report import markdown_table, record, write_record

__all__ = ["e2e_table", "WORKLOADS"]

QUESTIONS = [
    "Name three colours.", "What is the capital of France?", "Write a haiku about autumn.",
    "Explain photosynthesis in one sentence.", "List three prime numbers.", "What is 12 times 7?",
    "Give me a synonym for happy.", "Who wrote Hamlet?",
]
FEW_SHOT = "".join(
    f"Question: {q}\nAnswer: {a}\n\n" for q, a in [
        ("What is the boiling point of water at sea level?", "100 degrees Celsius, or 212 Fahrenheit."),
        ("Who painted the Mona Lisa?", "Leonardo da Vinci, in the early sixteenth century."),
        ("What is the largest planet in the solar system?", "Jupiter, a gas giant."),
        ("How many continents are there?", "Seven: Africa, Antarctica, Asia, Australia, Europe, "
         "North America and South America."),
        ("What gas do plants take in?", "Carbon dioxide, which they turn into sugar using sunlight."),
        ("What is the speed of light?", "About 300,000 kilometres per second in a vacuum."),
        ("Who discovered penicillin?", "Alexander Fleming, in 1928."),
        ("What is the chemical symbol for gold?", "Au, from the Latin aurum."),
        ("What is the tallest mountain on Earth?", "Mount Everest, 8,849 metres above sea level."),
        ("How many legs does a spider have?", "Eight."),
    ])


@dataclass(frozen=True)
class Workload:
    """``prompts`` (built from the tokenizer) decoded greedily or with ``beams`` beams."""

    name: str
    prompts: Callable[[Any], list[list[int]]]
    new_tokens: int
    beams: int = 0


def _chat(n: int) -> Callable[[Any], list[list[int]]]:
    return lambda tok: [tok.apply_chat_template(q) for q in QUESTIONS[:n]]


def _few_shot(tok: Any) -> list[list[int]]:
    return [tok.encode(f"{FEW_SHOT}Question: {q}\nAnswer:") for q in QUESTIONS]


def _document(tok: Any) -> list[list[int]]:
    notes = FEW_SHOT.replace("Question: ", "- ").replace("\nAnswer: ", " ")
    return [tok.apply_chat_template("Summarise these quiz notes in two sentences:\n\n" + notes * 4)]


WORKLOADS = [
    Workload("greedy, 1 chat prompt", _chat(1), 64),
    Workload("greedy, batch of 8 chat prompts", _chat(8), 64),
    Workload("greedy, 8 questions after one ~300-token few-shot prompt", _few_shot, 32),
    Workload("beam k=4, 1 chat prompt", _chat(1), 32, beams=4),
    Workload("beam k=4, batch of 4 chat prompts", _chat(4), 32, beams=4),
    Workload("beam k=4, 2 few-shot prompts", lambda tok: _few_shot(tok)[:2], 32, beams=4),
    Workload("beam k=4, 1 chat prompt with a ~1,000-token document", _document, 32, beams=4),
]


def e2e_table(device: str = "cpu", names: list[str] | None = None, reps: int = 3,
              progress: Callable[[str], None] | None = None, json_path: str | None = None) -> str:
    """Markdown table of DeFT vs ``transformers`` tokens/s per workload, and DeFT's time split
    (also written as a result record to ``json_path``, when given)."""
    import transformers

    from deft.engine import SamplingParams, TreeEngine, beam_search, generate
    from deft.model import load_model
    from deft.model.loader import DEFAULT_GGUF, default_model_path

    say = progress or (lambda msg: None)
    model, tok = load_model(device=device)
    ref = transformers.AutoModelForCausalLM.from_pretrained(
        os.path.dirname(default_model_path()), gguf_file=DEFAULT_GGUF, dtype=torch.float32).to(device).eval()
    stop = sorted(tok.eos_token_ids)
    gen_config = copy.deepcopy(ref.generation_config)
    gen_config.eos_token_id, gen_config.pad_token_id = stop, stop[-1]
    engine = TreeEngine(model, tok, num_pages=2048, device=device)
    rows = []
    for w in WORKLOADS:
        if names and w.name not in names:
            continue
        prompts = w.prompts(tok)

        def ours() -> list[list[int]]:
            if w.beams:
                return [h[0].token_ids for h in beam_search(engine, prompts, w.beams, w.new_tokens)]
            return [r.token_ids for r in generate(engine, prompts, SamplingParams(max_new_tokens=w.new_tokens))]

        def theirs() -> list[list[int]]:
            return _hf_generate(ref, gen_config, prompts, w.new_tokens, w.beams, stop, device)

        say(w.name)
        ours(), theirs()  # warm-up
        t_ours, t_hf, out, ref_out = float("inf"), float("inf"), [], []
        for _ in range(reps):
            t0 = time.perf_counter()
            out = ours()
            t_ours = min(t_ours, time.perf_counter() - t0)
            t0 = time.perf_counter()
            ref_out = theirs()
            t_hf = min(t_hf, time.perf_counter() - t0)
        split = _time_split(engine, ours)
        new = sum(map(len, out))
        same = sum(a == b for a, b in zip(out, ref_out))
        rows.append([w.name, sum(map(len, prompts)), new, new / t_ours, new / t_hf, t_hf / t_ours,
                     f"{same}/{len(out)}", *split])
    headers = ["workload", "prompt tokens", "new tokens", "DeFT tok/s", "transformers tok/s",
               "DeFT speed-up", "same tokens", "DeFT forwards", "ms/forward", "attention %",
               "plan+layout %", "outside forward %"]
    threads = torch.get_num_threads()
    if json_path:
        write_record(json_path, record(headers, rows, device, model="SmolLM2-135M-Instruct (float32)",
                                       threads=threads, reps=reps,
                                       transformers=transformers.__version__))
    return (f"SmolLM2-135M-Instruct (float32) on {device}, {threads} torch threads, best of {reps}; "
            f"transformers {transformers.__version__}, torch {torch.__version__}.\n\n"
            + markdown_table(headers, rows))


def _hf_generate(ref: Any, config: Any, prompts: list[list[int]], new_tokens: int, beams: int,
                 stop: list[int], device: str) -> list[list[int]]:
    """``transformers`` generate on a left-padded batch; per prompt the new ids up to a stop id."""
    width = max(map(len, prompts))
    pad = config.pad_token_id
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts], device=device)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=device)
    config = copy.deepcopy(config)
    config.max_new_tokens, config.do_sample, config.num_beams = new_tokens, False, max(beams, 1)
    with torch.no_grad():
        out = ref.generate(ids, attention_mask=mask, generation_config=config)[:, width:].tolist()
    cut = []
    for row in out:
        end = next((i + 1 for i, t in enumerate(row) if t in stop), len(row))
        cut.append(row[:end])
    return cut


def _time_split(engine: Any, run: Callable[[], object]) -> list[Any]:
    """One extra run of ``run`` with ``attn.run`` timed: forwards, ms per forward, and the
    shares of the wall time spent in attention, in planning (with layout) and outside the
    model forward (decoding policy, cache bookkeeping)."""
    attn, spent = engine.attn, [0.0]
    inner = attn.run

    def timed(*args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        out = inner(*args, **kwargs)
        spent[0] += time.perf_counter() - t0
        return out

    engine.reset_stats()
    attn.run = timed
    try:
        t0 = time.perf_counter()
        run()
        wall = time.perf_counter() - t0
    finally:
        del attn.run
    st = engine.stats
    pct = lambda x: 100 * x / wall  # noqa: E731
    return [st["steps"], 1e3 * st["forward_s"] / max(st["steps"], 1), pct(spent[0]), pct(st["plan_s"]),
            pct(wall - st["forward_s"])]
