"""What an FP8 K/V cache costs in accuracy: a model run over a shipped text with a 16-bit
cache and with an FP8 cache, side by side in one process.

* perplexity of the text (teacher forcing; the FP8 cache's scales calibrated on its first
  ``calibrate`` tokens, fed as the engine's first step, as generation's first prefill chunk
  does) and the share of positions whose argmax token agrees;
* greedy agreement: the tokens the two caches generate from the text's opening (a fresh
  engine each, so the FP8 scales are calibrated on that prompt, as in any generation), and
  where they first differ.

* long-context retrieval (:func:`retrieval`): a fact deep in a long prompt of random
  tokens, asked at the end, answered greedily with either cache.

The 16-bit cache is the model's dtype when it is 16-bit, else bfloat16 (a float32 model on
CPU). ``tools/kv_fp8_check.py`` prints it for any model; ``tests/test_fp8.py`` runs a short
version on SmolLM2.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np
import torch

TEXT = Path(__file__).with_name("data") / "kv_text.txt"


def text_ids(tok: Any, tokens: int | None = None) -> list[int]:
    """The shipped text's token ids (its first ``tokens`` ones)."""
    ids = tok.encode(TEXT.read_text())
    return ids if tokens is None else ids[:tokens]


def baseline_spec(model: Any) -> Any:
    """The 16-bit cache compared against: the model's dtype if 16-bit, else bfloat16."""
    from deft import KVSpec

    return KVSpec(model.dtype if model.dtype in (torch.float16, torch.bfloat16) else torch.bfloat16)


def kv_accuracy(model: Any, tok: Any, ids: list[int], kv: Any = "fp8_e4m3",
                calibrate: int = 64, prompt: int = 48, new_tokens: int = 32,
                backend: str = "auto") -> dict[str, Any]:
    """Perplexities, argmax agreement and greedy agreement of ``kv`` (an ``EngineConfig.kv``)
    against :func:`baseline_spec` over ``ids``; greedy decoding starts from ``ids[:prompt]``."""
    from deft.engine import SamplingParams, TreeEngine, generate

    pages = -(-(len(ids) + new_tokens + prompt) // 16) + 4
    out: dict[str, Any] = {"tokens": len(ids), "calibrate": calibrate}
    argmax, greedy = {}, {}
    for name, spec in (("base", baseline_spec(model)), ("test", kv)):
        engine = TreeEngine(model, tok, num_pages=pages, page_size=16, backend=backend, kv=spec)
        root = engine.add_prompt([])
        logits = torch.cat([engine.extend([(root, ids[:calibrate])], logits="all")[0],
                            engine.extend([(root, ids[calibrate:])], logits="all")[0]])
        target = torch.tensor(ids[1:], device=logits.device)
        nll = torch.nn.functional.cross_entropy(logits[:-1].float(), target)
        out[f"ppl_{name}"] = math.exp(float(nll))
        argmax[name] = logits[:-1].argmax(-1).cpu()
        fresh = TreeEngine(model, tok, num_pages=pages, page_size=16, backend=backend, kv=spec)
        params = SamplingParams(max_new_tokens=new_tokens, stop_token_ids=frozenset())
        greedy[name] = generate(fresh, [ids[:prompt]], params)[0].token_ids
    out["ppl_change"] = out["ppl_test"] / out["ppl_base"] - 1
    out["argmax_agreement"] = float((argmax["base"] == argmax["test"]).float().mean())
    a, b = greedy["base"], greedy["test"]
    out["greedy_same_prefix"] = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), len(a))
    out["greedy_tokens"] = len(a)
    return out


def retrieval(model: Any, tok: Any, context: int = 32768, depth: float = 0.25,
              kv: Any = "fp8_e4m3", backend: str = "auto", seed: int = 0,
              new_tokens: int = 12) -> dict[str, Any]:
    """A secret number stated at ``depth`` of a ``context``-token prompt (random tokens
    around it; at most the model's context), asked at the end: the greedy answers of a
    16-bit cache and of ``kv``, and whether each holds the number."""
    from deft.engine import SamplingParams, TreeEngine, generate

    context = min(context, model.config.max_position_embeddings - new_tokens)
    rng = np.random.default_rng(seed)
    secret = str(int(rng.integers(10000, 100000)))
    fact = tok.encode(f" The secret number is {secret}. Remember it: the secret number is "
                      f"{secret}. ")
    question = tok.encode(" Question: what is the secret number? Answer: the secret number is")
    # Ordinary tokens (ids past the special ones at the start of the vocabulary).
    filler = rng.integers(1000, model.config.vocab_size, context - len(fact) - len(question))
    at = int(depth * filler.shape[0])
    prompt = [*filler[:at].tolist(), *fact, *filler[at:].tolist(), *question]
    out: dict[str, Any] = {"context": len(prompt), "depth": depth, "secret": secret}
    params = SamplingParams(max_new_tokens=new_tokens, stop_token_ids=frozenset())
    for name, spec in (("base", baseline_spec(model)), ("test", kv)):
        engine = TreeEngine(model, tok, num_pages=-(-(len(prompt) + new_tokens) // 16) + 4,
                            page_size=16, backend=backend, kv=spec)
        answer = tok.decode(generate(engine, [prompt], params)[0].token_ids)
        out[f"answer_{name}"], out[f"found_{name}"] = answer, secret in answer
    return out
