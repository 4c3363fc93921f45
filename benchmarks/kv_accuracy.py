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
    for name, result in _answers(model, tok, prompt, kv, backend, new_tokens).items():
        answer = tok.decode(result.token_ids)
        out[f"answer_{name}"], out[f"found_{name}"] = answer, secret in answer
    return out


def _answers(model: Any, tok: Any, prompt: list[int], kv: Any, backend: str,
             new_tokens: int) -> dict[str, Any]:
    """The greedy continuations of ``prompt``, ``new_tokens`` long, with a 16-bit cache
    ("base") and with ``kv`` ("test"), each in an engine of its own."""
    from deft.engine import SamplingParams, TreeEngine, generate

    params = SamplingParams(max_new_tokens=new_tokens, stop_token_ids=frozenset())
    out = {}
    for name, spec in (("base", baseline_spec(model)), ("test", kv)):
        engine = TreeEngine(model, tok, num_pages=-(-(len(prompt) + new_tokens) // 16) + 4,
                            page_size=16, backend=backend, kv=spec)
        out[name] = generate(engine, [prompt], params)[0]
    return out


class NeedleTokens:
    """The token names of :func:`needle_model`: ``a{s}`` answers, ``f{s}`` facts, ``?`` the
    question, ``x{i}`` fillers (ids in that order); ``encode`` reads the ids back."""

    eos_token_ids: frozenset[int] = frozenset()

    def __init__(self, values: int, vocab_size: int) -> None:
        self.values, self.vocab_size = values, vocab_size

    def name(self, i: int) -> str:
        """Token ``i``'s name."""
        v = self.values
        return (f"a{i}" if i < v else f"f{i - v}" if i < 2 * v else "?" if i == 2 * v
                else f"x{i - 2 * v - 1}")

    def decode(self, ids: Any, skip_special_tokens: bool = False) -> str:
        """The names of ``ids``, space-separated."""
        return " ".join(self.name(int(i)) for i in ids)

    def encode(self, text: str) -> list[int]:
        """The ids of the space-separated names in ``text``."""
        names = {self.name(i): i for i in range(self.vocab_size)}
        return [names[w] for w in text.split()]


_HIDDEN, _HEAD_DIM, _HEADS = 256, 128, 4
_VALUE, _NOISE = 64, slice(192, 256)  # residual dims of the answers' values, fillers' noise


def needle_model(values: int = 100, fillers: int = 900, fact_score: float = 24.0,
                 seed: int = 0, max_positions: int = 131072) -> tuple[Any, NeedleTokens]:
    """A one-layer Llama whose weights are set by hand to answer a retrieval question: the
    question token's query matches the key of the fact token ``f{s}`` (score
    ``fact_score`` in natural-log units) and the fact's value names the answer ``a{s}``,
    read off by the LM head. Filler tokens have random keys as large per element as the
    fact's (their scores against the question: a standard deviation of about
    ``fact_score / sqrt(32)``), and the fact's value element (3.0) is within the range of
    the fillers' (about 3.7 at most), so FP8 scales calibrated on fillers alone clip
    neither. No trained model here has a 32k context; this one checks that a cache (FP8
    scales calibrated on the prompt's first chunk, pages, kernels) keeps one sharp attention
    peak among tens of thousands of tokens, not a trained model's accuracy
    (:func:`needle_retrieval` reports the fact's share of the attention).

    Keys and queries live in the head dims whose RoPE frequency is below 2e-7 per token
    (``rope_theta`` 1e9), so positions barely move the scores. Float32 weights, CPU."""
    from deft.model import LlamaConfig, LlamaModel

    if not 1 <= values <= _HEAD_DIM:
        raise ValueError(f"values: expected 1..{_HEAD_DIM} (one value dim each), got {values}")
    hidden, head_dim, heads, value = _HIDDEN, _HEAD_DIM, _HEADS, _VALUE
    vocab = 2 * values + 1 + fillers
    config = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=16,
                         num_layers=1, num_heads=heads, num_kv_heads=1, head_dim=head_dim,
                         rope_theta=1e9, max_position_embeddings=max_positions)
    with torch.device("cpu"):
        model = LlamaModel(config).eval().requires_grad_(False)
    gen = torch.Generator().manual_seed(seed)
    root = hidden**0.5
    # Residual dims: 0 the fact marker, 1 the question, 2 answers, 64.. the value of each
    # answer, 192..255 the fillers' noise. Every embedding has norm sqrt(hidden) (the
    # attention's RMSNorm leaves it as is).
    emb = torch.zeros(vocab, hidden)
    fact_value = 3.0
    a = (hidden - fact_value**2) ** 0.5  # the fact marker
    for s in range(values):
        emb[s, 2] = root
        emb[values + s, 0], emb[values + s, value + s] = a, fact_value
    emb[2 * values, 1] = root
    fill = torch.zeros(fillers, hidden)
    fill[:, _NOISE] = torch.randn(fillers, 64, generator=gen)
    fill[:, value:value + head_dim] = torch.randn(fillers, head_dim, generator=gen) * 0.5
    emb[2 * values + 1:] = fill * (root / fill.norm(dim=1, keepdim=True))
    model.embed.weight.copy_(emb)

    slow = torch.cat([torch.arange(48, 64), torch.arange(112, 128)])  # the slowest RoPE pairs
    signs = torch.randint(0, 2, (slow.numel(),), generator=gen) * 2 - 1
    direction = torch.zeros(head_dim)
    direction[slow] = signs / slow.numel()**0.5
    k_norm = 8.0
    wk = torch.zeros(head_dim, hidden)
    wk[:, 0] = direction * (k_norm / a)
    # Fillers' keys: random in the slow dims, scaled to the fact key's per-element size.
    mix = torch.zeros(head_dim, 64)
    mix[slow] = torch.randn(slow.numel(), 64, generator=gen)
    keys = emb[2 * values + 1:, _NOISE] @ mix.T
    wk[:, _NOISE] = mix * (k_norm / slow.numel()**0.5 / keys[:, slow].std())
    wq = torch.zeros(heads * head_dim, hidden)
    wq[:, 1] = direction.repeat(heads) * (fact_score * head_dim**0.5 / k_norm / root)
    wv = torch.zeros(head_dim, hidden)
    wv[:, value:value + head_dim] = torch.eye(head_dim)
    layer = model.layers[0]
    layer.qkv.weight.copy_(torch.cat([wq, wk, wv]))
    wo = torch.zeros(hidden, heads * head_dim)
    for h in range(heads):
        wo[value:value + head_dim, h * head_dim:(h + 1) * head_dim] = torch.eye(head_dim) / heads
    layer.o.weight.copy_(wo)
    layer.gate_up.weight.zero_()
    layer.down.weight.zero_()
    head = torch.zeros(vocab, hidden)
    head[torch.arange(values), value + torch.arange(values)] = 4.0
    model.lm_head.weight.copy_(head)
    return model, NeedleTokens(values, vocab)


def _fact_share(model: Any, prompt: list[int], at: int) -> float:
    """The question's (last token's) attention share on position ``at`` in float64, RoPE
    left out (it turns :func:`needle_model`'s scores by under 0.03 radians at 131k)."""
    emb = model.embed.weight.detach().double().cpu()
    w = model.layers[0].qkv.weight.detach().double().cpu()
    q = w[:_HEAD_DIM] @ emb[prompt[-1]]
    k = emb[torch.tensor(prompt)] @ w[_HEADS * _HEAD_DIM:(_HEADS + 1) * _HEAD_DIM].T
    return float(torch.softmax(k @ q / _HEAD_DIM**0.5, 0)[at])


def needle_retrieval(context: int = 32768, depth: float = 0.25, kv: Any = "fp8_e4m3",
                     device: str = "cpu", dtype: torch.dtype = torch.float32,
                     backend: str = "auto", seed: int = 0,
                     fact_score: float = 24.0) -> dict[str, Any]:
    """:func:`needle_model`'s question after ``context`` tokens with the fact at ``depth``:
    the answer with a 16-bit cache and with ``kv``, whether each is the fact's and its
    probability, and the fact's share of the question's attention (float64, no cache)."""
    model, tok = needle_model(fact_score=fact_score, seed=seed,
                              max_positions=max(context + 16, 1024))
    model = model.to(device=device, dtype=dtype)
    rng = np.random.default_rng(seed)
    secret = int(rng.integers(1, tok.values))
    filler = rng.integers(2 * tok.values + 1, tok.vocab_size, context - 2).tolist()
    at = int(depth * len(filler))
    prompt = [*filler[:at], tok.values + secret, *filler[at:], 2 * tok.values]
    out: dict[str, Any] = {"context": len(prompt), "depth": depth, "secret": f"a{secret}",
                           "fact_share": _fact_share(model, prompt, at)}
    for name, result in _answers(model, tok, prompt, kv, backend, 1).items():
        answer = tok.decode(result.token_ids)
        out[f"answer_{name}"], out[f"found_{name}"] = answer, answer == f"a{secret}"
        out[f"p_answer_{name}"] = math.exp(result.score)
    return out
