"""Every decoding strategy on one engine, for the device tests: what each returns, as plain
values that two engines (devices, backends) can be compared on."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from deft.engine import (Expansion, ModelDrafter, NgramDrafter, SamplingParams, TopKShape,
                         TreeEngine, beam_search, generate, replay_trace, sample,
                         speculative_generate, tree_search)
from deft.model import LlamaConfig, LlamaModel, Tokenizer

VOCAB = 64
PROMPT = [(7 * i + 3) % VOCAB for i in range(300)]


def tokenizer() -> Tokenizer:
    from tokenizers import Tokenizer as Backend
    from tokenizers import models

    vocab = {f"t{i}": i for i in range(VOCAB)}
    return Tokenizer(Backend(models.WordLevel(vocab, unk_token="t0")), eos_token_ids=[])


def model(device: str, dtype: torch.dtype, seed: int = 0, layers: int = 3) -> LlamaModel:
    """A random Llama-shaped model (GQA 4, head_dim 32). The final norm is scaled up so
    greedy choices have clear margins and cannot flip on rounding differences."""
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=256, intermediate_size=512,
                         num_layers=layers, num_heads=8, num_kv_heads=2,
                         max_position_embeddings=2048)
    m = LlamaModel(config).eval().requires_grad_(False)
    m.norm.weight.mul_(4.0)
    return m.to(device, dtype)


# A small Medusa-style draft tree (choice paths: the i-th candidate at each depth).
MEDUSA_CHOICES = [[0], [1], [2], [0, 0], [0, 1], [1, 0], [0, 0, 0], [0, 0, 1], [0, 0, 0, 0]]


def write_trace(path: Path) -> None:
    """A small reasoning record: a 40-token prompt, 3 thoughts, one of which branches in 2."""
    data = {"0": {"id": 0, "value": 40, "start": -39, "end": 0, "children": [1, 2, 3]},
            "1": {"id": 1, "value": 5, "start": 1, "end": 5, "children": [4, 5]},
            "2": {"id": 2, "value": 3, "start": 1, "end": 3, "children": []},
            "3": {"id": 3, "value": 8, "start": 1, "end": 8, "children": []},
            "4": {"id": 4, "value": 4, "start": 6, "end": 9, "children": []},
            "5": {"id": 5, "value": 2, "start": 6, "end": 7, "children": []}}
    path.write_text(json.dumps([{"incompleted": True, "prompt": "", "data": {}},
                                {"incompleted": False, "prompt": "x", "data": data}]))


def run_strategies(engine: TreeEngine, draft: TreeEngine, prompt: list[int],
                   trace: Path) -> dict[str, object]:
    """Token ids (and scores where a strategy has them) of every strategy from ``prompt``."""
    greedy = SamplingParams(max_new_tokens=12, stop_token_ids=frozenset())
    sampled = SamplingParams(max_new_tokens=8, temperature=0.9, top_k=20, seed=3,
                             stop_token_ids=frozenset())
    beams = beam_search(engine, prompt, num_beams=3, max_new_tokens=8, num_return_sequences=3)

    def expand(t):  # noqa: ANN001, ANN202
        return [Expansion(params=SamplingParams(max_new_tokens=3, stop_token_ids=frozenset())),
                [prompt[t.depth]]]

    thoughts = tree_search(engine, prompt, expand, lambda t: float(sum(t.path_token_ids()) % 7),
                           beam_width=2, max_depth=2)
    return {
        "generate": [r.token_ids for r in generate(engine, [prompt, prompt[:30]], greedy)],
        "sample": [r.token_ids for r in sample(engine, prompt, 3, sampled)[0]],
        "beam": [(r.token_ids, round(r.score, 3)) for r in beams[0]],
        "tree_search": [t.path_token_ids() for t in thoughts],
        "speculative ngram": [r.token_ids for r in speculative_generate(
            engine, [prompt * 2], greedy, NgramDrafter())],
        "speculative model": [r.token_ids for r in speculative_generate(
            engine, [prompt], greedy, ModelDrafter(draft))],
        "speculative Medusa tree": [r.token_ids for r in speculative_generate(
            engine, [prompt], greedy, ModelDrafter(draft), tree=MEDUSA_CHOICES)],
        "speculative top-k tree": [r.token_ids for r in speculative_generate(
            engine, [prompt], greedy, ModelDrafter(draft), tree=TopKShape(k=3, depth=4, width=3))],
        "replay": replay_trace(engine, trace, tokens="greedy").decode_tokens,
    }
