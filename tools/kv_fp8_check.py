"""What an FP8 K/V cache costs in accuracy, against a 16-bit cache, on a real model.

Prints, as JSON lines (``benchmarks.kv_accuracy``): perplexity of the shipped text
(``benchmarks/data/kv_text.txt``) with each cache, the share of positions whose argmax
agrees, greedy agreement from the text's opening; with ``--retrieval``, a secret number
placed at ``--depth`` of a ``--context``-token prompt of random tokens (clipped to the
model's context) and asked at the end, answered with each cache. ``--needle`` runs only the
retrieval check, on a constructed one-layer model whose context is any length
(``benchmarks.kv_accuracy.needle_model``: it checks the cache keeps one sharp attention peak
among ``--context`` tokens, not a trained model's accuracy).

Usage: PYTHONPATH=. python3 tools/kv_fp8_check.py [--model PATH] [--device cuda]
       [--dtype bfloat16] [--new-tokens 32] [--retrieval [--context 32768] [--depth 0.25]]
       PYTHONPATH=. python3 tools/kv_fp8_check.py --needle [--context 32768] [--depth 0.25]
       [--device cuda] [--dtype bfloat16]
(the default model is deft's SmolLM2-135M, 8k context; a long-context check needs a model
of at least ``--context`` positions, e.g. a Llama-3.1-8B checkpoint)
"""
import argparse
import json

import torch

from benchmarks.kv_accuracy import kv_accuracy, needle_retrieval, retrieval, text_ids
from deft.model import load_model

p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
p.add_argument("--model", help="GGUF file or Hugging Face directory (default: deft's default model)")
p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
p.add_argument("--dtype", choices=("bfloat16", "float16", "float32"),
               help="weights' dtype (default: bfloat16 on cuda, float32 on cpu)")
p.add_argument("--new-tokens", type=int, default=32, help="greedy tokens (default 32)")
p.add_argument("--retrieval", action="store_true", help="also the long-context retrieval check")
p.add_argument("--context", type=int, default=32768, help="retrieval prompt tokens (default 32768)")
p.add_argument("--depth", type=float, default=0.25, help="where the fact sits, 0..1 (default 0.25)")
p.add_argument("--needle", action="store_true",
               help="only the retrieval check, on a constructed one-layer model of any "
                    "--context (--model and --new-tokens do not apply)")
args = p.parse_args()

dtype = getattr(torch, args.dtype or ("bfloat16" if args.device == "cuda" else "float32"))
if args.needle:
    for seed in range(3):
        print(json.dumps({"check": "needle", "seed": seed, **needle_retrieval(
            args.context, args.depth, device=args.device, dtype=dtype, seed=seed)}), flush=True)
    raise SystemExit(0)
model, tok = load_model(args.model, device=args.device, dtype=dtype)
print(json.dumps({"check": "text", **kv_accuracy(model, tok, text_ids(tok),
                                                new_tokens=args.new_tokens)}), flush=True)
if args.retrieval:
    for seed in range(3):
        print(json.dumps({"check": "retrieval", "seed": seed,
                          **retrieval(model, tok, args.context, args.depth, seed=seed)}), flush=True)
