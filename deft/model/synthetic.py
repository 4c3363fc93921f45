"""Random-weight models of known shapes: served and benchmarked with no checkpoint to load.

A model spec ``random:NAME`` or ``random:NAME:layers=N`` names one, wherever a command takes
``--model``: NAME is ``llama-3-8b`` (Llama-3-8B's shapes: vocabulary 128256, hidden 4096,
MLP 14336, 32 layers, 32 query and 8 KV heads of 128, RoPE theta 500000) or ``tiny`` (a
2-layer model for tests); ``layers=N`` keeps the first N layers' shapes. The weights are
drawn with a fixed seed on the target device itself, bf16 on CUDA and float32 elsewhere.

The tokenizer (:func:`byte_tokenizer`) is byte-level, so any text encodes deterministically
and texts that share a prefix share its ids: ids 0-255 are the UTF-8 bytes, 256 and 257 the
ChatML markers ``<|im_start|>`` and ``<|im_end|>`` (the end-of-turn token), and every other
id decodes to the placeholder word `` t{id}``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace

import torch
from tokenizers import AddedToken, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as Backend

from ..checks import int_in_range
from .config import LlamaConfig
from .llama import LlamaModel
from .loader import resolve_device, resolve_dtype
from .tokenizer import Tokenizer

__all__ = ["SHAPES", "RandomSpec", "byte_tokenizer", "is_random_spec", "load_random", "parse_spec",
           "random_model"]

PREFIX = "random:"
SHAPES = {
    "llama-3-8b": LlamaConfig(vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                              num_layers=32, num_heads=32, num_kv_heads=8,
                              max_position_embeddings=8192, rope_theta=500000.0),
    # Qwen3-8B: per-head q/k RMSNorm, 36 layers, MLP 12288, a 151,936-token vocabulary.
    "qwen3-8b": LlamaConfig(vocab_size=151936, hidden_size=4096, intermediate_size=12288,
                            num_layers=36, num_heads=32, num_kv_heads=8, head_dim=128,
                            max_position_embeddings=40960, rope_theta=1000000.0,
                            rms_norm_eps=1e-6, qk_norm=True),
    "tiny": LlamaConfig(vocab_size=2048, hidden_size=64, intermediate_size=128, num_layers=2,
                        num_heads=4, num_kv_heads=2, max_position_embeddings=8192),
}
MAX_LAYERS = 1024
SEED = 0
BOS, EOS = "<|im_start|>", "<|im_end|>"
CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
                 "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
_SPEC = re.compile(r"random:([a-z0-9-]+)(?::layers=(\d+))?")


@dataclass(frozen=True)
class RandomSpec:
    """A random model: ``name`` a key of :data:`SHAPES`, ``layers`` ``None`` for its own count."""

    name: str
    layers: int | None = None

    def __post_init__(self) -> None:
        if self.name not in SHAPES:
            raise ValueError(f"name: expected one of {', '.join(SHAPES)}, got {self.name!r}")
        if self.layers is not None:
            int_in_range(self.layers, "layers", 1, MAX_LAYERS)

    @property
    def config(self) -> LlamaConfig:
        base = SHAPES[self.name]
        return base if self.layers is None else replace(base, num_layers=self.layers)

    def __str__(self) -> str:
        return PREFIX + self.name + ("" if self.layers is None else f":layers={self.layers}")


def is_random_spec(model: str | None) -> bool:
    """Whether ``model`` (a ``--model`` value) names a random-weight model, not a path."""
    return model is not None and model.startswith(PREFIX)


def parse_spec(spec: str) -> RandomSpec:
    """``random:NAME`` or ``random:NAME:layers=N`` as a :class:`RandomSpec`; else a
    ``ValueError`` saying what is accepted."""
    m = _SPEC.fullmatch(spec)
    if m is None:
        raise ValueError(f"expected random:NAME or random:NAME:layers=N (NAME one of {', '.join(SHAPES)}), "
                         f"got {spec!r}")
    return RandomSpec(m.group(1), None if m.group(2) is None else int(m.group(2)))


def random_model(config: LlamaConfig, device: str | torch.device = "cpu",
                 dtype: torch.dtype | None = None, seed: int = SEED) -> LlamaModel:
    """A :class:`LlamaModel` of ``config`` with random weights, initialised on ``device`` from
    ``seed`` (the device's generator is restored afterwards) and cast to ``dtype`` (default
    bf16 on CUDA, float32 elsewhere), ready for inference."""
    device = torch.device(device)
    if dtype is None:
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    cuda = [] if device.type != "cuda" else [
        torch.cuda.current_device() if device.index is None else device.index]
    with torch.random.fork_rng(devices=cuda), torch.device(device):
        (torch.cuda.default_generators[cuda[0]] if cuda else torch.default_generator).manual_seed(seed)
        model = LlamaModel(config)
    return model.to(dtype).eval().requires_grad_(False)


def _byte_symbols() -> list[str]:
    """The character that stands for each byte in a byte-level vocabulary (index: the byte):
    printable Latin-1 characters for themselves, the others shifted past U+00FF in order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), 256)]
    shifted = iter(range(256, 512))
    return [chr(b) if b in printable else chr(next(shifted)) for b in range(256)]


def byte_tokenizer(vocab_size: int) -> Tokenizer:
    """The byte-level tokenizer of a random model with ``vocab_size`` >= 258 ids (module
    docstring): ChatML chat template, ``<|im_end|>`` as end-of-turn token."""
    if vocab_size < 258:
        raise ValueError(f"vocab_size: expected at least 258 (bytes and two markers), got {vocab_size}")
    symbols = _byte_symbols()
    space = symbols[ord(" ")]
    vocab = {s: b for b, s in enumerate(symbols)} | {BOS: 256, EOS: 257}
    vocab |= {f"{space}t{i}": i for i in range(258, vocab_size)}
    backend = Backend(models.BPE(vocab, []))  # no merges: one token per byte
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens([AddedToken(BOS, special=True), AddedToken(EOS, special=True)])
    return Tokenizer(backend, eos_token_ids=[257], chat_template=CHAT_TEMPLATE, bos_token=BOS, eos_token=EOS)


def load_random(spec: str, device: str | torch.device = "cpu",
                dtype: torch.dtype | str = "auto") -> tuple[LlamaModel, Tokenizer]:
    """The random model of ``spec`` (:func:`parse_spec`) on ``device`` in ``dtype`` (a
    ``torch.dtype``, its name, or ``auto``: bf16 on CUDA, float32 elsewhere) and its tokenizer."""
    config, device = parse_spec(spec).config, resolve_device(device)
    return random_model(config, device, resolve_dtype(dtype, device)), byte_tokenizer(config.vocab_size)
