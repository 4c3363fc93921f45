"""Time ``load_model`` of an 8B-shaped random checkpoint onto the GPU.

Writes (once, into ``--dir``) a random Llama-3-8B-shaped checkpoint with ``transformers`` in
bfloat16 safetensors shards (``--family qwen3`` for Qwen3-8B's shapes), then loads it with
:func:`deft.model.load_model` onto ``cuda`` in its own dtype and prints seconds, GB/s of the
checkpoint's bytes and peak GPU memory over the weights' size (1.0: each tensor was read once,
straight to the device, with no second copy)::

    PYTHONPATH=. python tools/load_time.py --dir /tmp/llama8b
    PYTHONPATH=. python tools/load_time.py --dir /tmp/qwen3_8b --family qwen3
"""

from __future__ import annotations

import argparse
import glob
import os
import time

import torch

SHAPES = {  # the published 8B configs' shapes
    "llama": ("LlamaConfig", "LlamaForCausalLM", dict(
        vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=8192, rope_theta=500000.0)),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(
        vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
        num_attention_heads=32, num_key_value_heads=8, head_dim=128, max_position_embeddings=8192,
        rope_theta=1000000.0)),
}


def write_checkpoint(folder: str, family: str) -> None:
    """A random ``family`` 8B-shaped bfloat16 checkpoint and a byte-level tokenizer in ``folder``."""
    import transformers

    from deft.model.synthetic import byte_tokenizer

    config_cls, model_cls, shape = SHAPES[family]
    config = getattr(transformers, config_cls)(**shape, tie_word_embeddings=False, dtype="bfloat16")
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)  # initialised in bf16 on the GPU: seconds, not minutes
    try:
        with torch.device("cuda"):
            model = getattr(transformers, model_cls)(config)
    finally:
        torch.set_default_dtype(default)
    model.save_pretrained(folder, max_shard_size="5GB")
    del model
    byte_tokenizer(shape["vocab_size"]).backend.save(os.path.join(folder, "tokenizer.json"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dir", required=True, help="checkpoint directory (written if empty)")
    parser.add_argument("--family", choices=sorted(SHAPES), default="llama")
    parser.add_argument("--reps", type=int, default=2, help="timed loads (the first warms the page cache)")
    args = parser.parse_args()
    if not os.path.isfile(os.path.join(args.dir, "config.json")):
        print(f"writing a random {args.family} 8B-shaped checkpoint to {args.dir} ...", flush=True)
        write_checkpoint(args.dir, args.family)
    from deft.model import load_model

    size = sum(os.path.getsize(f) for f in glob.glob(os.path.join(args.dir, "*.safetensors")))
    for rep in range(args.reps):
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        torch.cuda.synchronize()
        start = time.perf_counter()
        model, _ = load_model(args.dir, device="cuda")  # dtype auto: the checkpoint's bfloat16
        torch.cuda.synchronize()
        seconds = time.perf_counter() - start
        weights = sum(p.numel() * p.element_size() for p in model.parameters())
        print(f"load {rep + 1}: {seconds:.2f} s, {size / seconds / 1e9:.2f} GB/s of {size / 1e9:.2f} GB, "
              f"{model.dtype}, peak GPU memory {torch.cuda.max_memory_allocated() / weights:.2f}x the weights",
              flush=True)
        del model


if __name__ == "__main__":
    main()
