"""What an FP8 K/V cache costs in accuracy: a model run over a shipped text with a 16-bit
cache and with an FP8 cache, side by side in one process.

* perplexity of the text (teacher forcing; the FP8 cache's scales calibrated on its first
  ``calibrate`` tokens, fed as the engine's first step, as generation's first prefill chunk
  does) and the share of positions whose argmax token agrees;
* greedy agreement: the tokens the two caches generate from the text's opening (a fresh
  engine each, so the FP8 scales are calibrated on that prompt, as in any generation), and
  where they first differ.

The 16-bit cache is the model's dtype when it is 16-bit, else bfloat16 (a float32 model on
CPU). ``tools/kv_fp8_check.py`` prints it for any model; ``tests/test_fp8.py`` runs a short
version on SmolLM2.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

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
