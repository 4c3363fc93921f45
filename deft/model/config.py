"""The decoder configuration: one frozen, validated object for every family.

Covers Llama 2/3 (incl. ``llama3`` and ``linear`` RoPE scaling), SmolLM2 and Mistral-style
GQA, with tied or untied embeddings, and the flags other families switch on (q/k/v biases,
per-head q/k RMSNorm; Gemma's ``(1 + w)`` sandwich norms, GeGLU, embedding and softmax
scales and per-layer RoPE; Phi-3's ``longrope`` scaling). Built from a Hugging Face ``config.json``
(:meth:`LlamaConfig.from_hf_config`; a family's module adapts its keys first) or from GGUF
metadata (:meth:`LlamaConfig.from_gguf_metadata`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from numbers import Real
from typing import Any, Mapping, Sequence

from ..checks import context_text, int_in_range, is_int, positive_int, real_number

__all__ = ["ACTIVATIONS", "LlamaConfig", "RopeScaling", "ROPE_SCALING_KINDS", "rope_from_hf"]

ROPE_SCALING_KINDS = ("linear", "llama3", "longrope")
# The MLP's gate activations, by their Hugging Face names: SwiGLU and Gemma's GeGLU.
ACTIVATIONS = ("silu", "gelu_pytorch_tanh")
# The RoPE table holds every position up to max_position_embeddings; its angles are computed
# in float32, exact for integer positions up to 2**24 (like the reference implementation).
MAX_POSITIONS = 1 << 24


def _pos_float(value: Any, name: str) -> float:
    return real_number(value, name, "a positive finite number", lambda x: x > 0)


def _check_count(factors: tuple[float, ...], name: str, rope_dim: int) -> tuple[float, ...]:
    """``factors``, one per rotated pair of the ``rope_dim`` dims RoPE rotates."""
    if len(factors) != rope_dim // 2:
        raise ValueError(f"{name}: expected one per rotated pair of dims, {rope_dim // 2} values, "
                         f"got {len(factors)}")
    return factors


@dataclass(frozen=True)
class RopeScaling:
    """RoPE frequency scaling.

    ``linear`` divides every inverse frequency by ``factor``; ``llama3`` (Llama 3.1+)
    divides the low frequencies by ``factor``, keeps the high ones and interpolates
    between ``low_freq_factor`` and ``high_freq_factor`` wavelengths of
    ``original_max_position_embeddings``. ``longrope`` (the 128k Phi-3 and Phi-3.5) divides
    each inverse frequency by its ``short_factor``, the factors of positions within
    ``original_max_position_embeddings`` (a config with it is capped there: its long factors
    would re-rotate every position, cached keys included); ``factor`` is the extended
    context over the original one.

    cos and sin are multiplied by ``attention_factor``; ``None`` gives LongRoPE's
    ``sqrt(1 + ln(factor) / ln(original_max_position_embeddings))`` (1 where ``factor``
    <= 1) and 1 for the other kinds.
    """

    kind: str
    factor: float
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    short_factor: tuple[float, ...] = field(default=(), repr=False)
    attention_factor: float | None = None

    def __post_init__(self) -> None:
        if self.kind not in ROPE_SCALING_KINDS:
            raise ValueError(
                f"rope_scaling: expected a type of {', '.join(ROPE_SCALING_KINDS)}, got {self.kind!r}"
            )
        factor = _pos_float(self.factor, "rope_scaling.factor")
        object.__setattr__(self, "factor", factor)
        lo = _pos_float(self.low_freq_factor, "rope_scaling.low_freq_factor")
        hi = _pos_float(self.high_freq_factor, "rope_scaling.high_freq_factor")
        if self.kind == "llama3" and hi <= lo:
            raise ValueError(
                f"rope_scaling.high_freq_factor: expected > low_freq_factor={lo}, got {hi}"
            )
        object.__setattr__(self, "low_freq_factor", lo)
        object.__setattr__(self, "high_freq_factor", hi)
        original = positive_int(self.original_max_position_embeddings,
                                "rope_scaling.original_max_position_embeddings")
        longrope = self.kind == "longrope"
        if not isinstance(self.short_factor, Sequence) or bool(self.short_factor) != longrope:
            expected = "a list of numbers" if longrope else f"none for {self.kind!r} scaling"
            raise ValueError(f"rope_scaling.short_factor: expected {expected}, got {self.short_factor!r}")
        object.__setattr__(self, "short_factor", tuple(
            _pos_float(f, "rope_scaling.short_factor[i]") for f in self.short_factor))
        attention = self.attention_factor
        if attention is None:
            attention = (math.sqrt(1 + math.log(factor) / math.log(original))
                         if longrope and factor > 1 else 1.0)
        object.__setattr__(self, "attention_factor", _pos_float(attention, "rope_scaling.attention_factor"))


def _longrope_context(scaling: RopeScaling | None, max_pos: int) -> tuple[int, str]:
    """The context a config may take and what capped it: LongRoPE's original context (see
    :class:`RopeScaling`), else ``max_pos`` uncapped."""
    if scaling is not None and scaling.kind == "longrope":
        original = scaling.original_max_position_embeddings
        if max_pos > original:
            return original, "LongRoPE's original context"
    return max_pos, ""


def rope_from_hf(
    rope: Any, theta: Any = None, max_position_embeddings: Any = None
) -> tuple[float, RopeScaling | None]:
    """``(theta, scaling)`` of a Hugging Face RoPE object (``rope_parameters``, or the older
    ``rope_scaling``); ``theta`` where the config states it apart, else the object's (10000).
    ``max_position_embeddings`` (the config's) is LongRoPE's default original context, and
    its ratio to the original one LongRoPE's default ``factor``, as in transformers."""
    if not isinstance(rope, Mapping):
        raise ValueError(f"rope_scaling: expected an object, got {rope!r}")
    kind = rope.get("rope_type", rope.get("type", "default"))
    scaling = None
    if kind == "longrope":
        original = positive_int(rope.get("original_max_position_embeddings", max_position_embeddings),
                                "rope_scaling.original_max_position_embeddings")
        factor = rope.get("factor")
        if factor is None:
            factor = positive_int(max_position_embeddings, "max_position_embeddings") / original
        scaling = RopeScaling(kind, factor, original_max_position_embeddings=original,
                              short_factor=rope.get("short_factor"),
                              attention_factor=rope.get("attention_factor"))
    elif kind != "default":
        scaling = RopeScaling(
            kind=kind,
            factor=rope.get("factor"),
            low_freq_factor=rope.get("low_freq_factor", 1.0),
            high_freq_factor=rope.get("high_freq_factor", 4.0),
            original_max_position_embeddings=rope.get("original_max_position_embeddings", 8192),
        )
    return rope.get("rope_theta", 10000.0) if theta is None else theta, scaling


@dataclass(frozen=True)
class LlamaConfig:
    """Shape and numerics of a Llama-family decoder.

    ``head_dim`` defaults to ``hidden_size // num_heads``; ``rotary_dim`` (0: the whole head;
    :attr:`rope_dim` is the count in effect) is how many of a head's leading dims RoPE
    rotates, the rest passing through (partial rotary: Phi-4-mini's 96 of 128). ``rope_freq_factors``
    (``rope_dim // 2`` divisors of the inverse frequencies, what GGUF's ``rope_freqs``
    tensor stores for Llama 3.1) applies on top of ``rope_scaling``. ``attention_bias``:
    q/k/v and o projections have biases; ``qkv_bias``: only q/k/v do (Qwen2); ``qk_norm``:
    each q and k head is RMS-normalised over ``head_dim`` before RoPE (Qwen3), one weight
    shared by the heads, so any subset of heads normalises the same.

    Gemma's flags: ``hidden_act`` the MLP gate's activation (:data:`ACTIVATIONS`);
    ``norm_plus_one``: every RMSNorm scales by ``1 + w`` in float32 and rounds last (Llama
    rounds before scaling by ``w``); ``sandwich_norms``: the attention and MLP outputs are
    RMS-normalised before their residual adds; ``embed_scale``: the embeddings are multiplied
    by it (rounded to the weights' dtype); ``query_pre_attn_scalar``: the softmax scale is its
    inverse square root (default: ``head_dim``'s); ``local_rope_layers``: the layers whose
    RoPE is ``local_rope_theta``/``local_rope_scaling`` instead of
    ``rope_theta``/``rope_scaling`` (Gemma 3's sliding-window layers); ``nope_layers``: the
    layers whose q and k take no RoPE at all (SmolLM3's every fourth).

    ``context_cap``: what lowered ``max_position_embeddings`` below the checkpoint's own
    context (e.g. ``"its sliding window"``), said in the errors of a prompt beyond it.
    """

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int = 0
    rotary_dim: int = 0
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    rope_freq_factors: tuple[float, ...] | None = field(default=None, repr=False)
    max_position_embeddings: int = 8192
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    mlp_bias: bool = False
    qkv_bias: bool = False
    qk_norm: bool = False
    hidden_act: str = "silu"
    norm_plus_one: bool = False
    sandwich_norms: bool = False
    embed_scale: float = 1.0
    query_pre_attn_scalar: float | None = None
    local_rope_theta: float = 10000.0
    local_rope_scaling: RopeScaling | None = None
    local_rope_layers: tuple[int, ...] = ()
    nope_layers: tuple[int, ...] = ()
    context_cap: str = ""

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                     "num_kv_heads"):
            positive_int(getattr(self, name), name)
        int_in_range(self.max_position_embeddings, "max_position_embeddings", 1, MAX_POSITIONS)
        if self.head_dim == 0:
            if self.hidden_size % self.num_heads:
                raise ValueError(
                    f"hidden_size: expected a multiple of num_heads={self.num_heads} when head_dim "
                    f"is not given, got {self.hidden_size}"
                )
            object.__setattr__(self, "head_dim", self.hidden_size // self.num_heads)
        positive_int(self.head_dim, "head_dim")
        if self.rotary_dim == 0:  # RoPE over the whole head
            if self.head_dim % 2:
                raise ValueError(f"head_dim: expected an even number (rotate-half RoPE), got "
                                 f"{self.head_dim}")
        elif int_in_range(self.rotary_dim, "rotary_dim", 2, self.head_dim) % 2:
            raise ValueError(f"rotary_dim: expected an even number (rotate-half RoPE), got "
                             f"{self.rotary_dim}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads: expected a multiple of num_kv_heads={self.num_kv_heads}, got {self.num_heads}"
            )
        object.__setattr__(self, "rms_norm_eps", _pos_float(self.rms_norm_eps, "rms_norm_eps"))
        for name in ("rope_theta", "local_rope_theta", "embed_scale"):
            object.__setattr__(self, name, _pos_float(getattr(self, name), name))
        for name in ("rope_scaling", "local_rope_scaling"):
            s = getattr(self, name)
            if s is not None and not isinstance(s, RopeScaling):
                raise TypeError(f"{name}: expected a RopeScaling or None, got {type(s).__name__}")
            if s is not None and s.kind == "longrope":
                _check_count(s.short_factor, f"{name}.short_factor", self.rope_dim)
                if self.max_position_embeddings > s.original_max_position_embeddings:
                    raise ValueError(
                        f"max_position_embeddings: expected at most {name}.original_max_position_"
                        f"embeddings={s.original_max_position_embeddings} (LongRoPE's short factors "
                        f"hold only within it), got {self.max_position_embeddings}"
                    )
        if self.query_pre_attn_scalar is not None:
            object.__setattr__(self, "query_pre_attn_scalar",
                               _pos_float(self.query_pre_attn_scalar, "query_pre_attn_scalar"))
        if self.hidden_act not in ACTIVATIONS:
            raise ValueError(f"hidden_act: expected one of {', '.join(ACTIVATIONS)}, got {self.hidden_act!r}")
        for name in ("local_rope_layers", "nope_layers"):
            layers = tuple(int_in_range(i, f"{name}[{j}]", 0, self.num_layers - 1)
                           for j, i in enumerate(getattr(self, name)))
            if list(layers) != sorted(set(layers)):
                raise ValueError(f"{name}: expected increasing layer indices, got {layers}")
            object.__setattr__(self, name, layers)
        if self.rope_freq_factors is not None:
            factors = tuple(_pos_float(f, "rope_freq_factors[i]") for f in self.rope_freq_factors)
            object.__setattr__(self, "rope_freq_factors", _check_count(factors, "rope_freq_factors",
                                                                       self.rope_dim))
        for name in ("tie_word_embeddings", "attention_bias", "mlp_bias", "qkv_bias", "qk_norm",
                     "norm_plus_one", "sandwich_norms"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name}: expected a bool, got {getattr(self, name)!r}")

    @property
    def rope_dim(self) -> int:
        """How many of a head's leading dims RoPE rotates (``rotary_dim``, else the head's)."""
        return self.rotary_dim or self.head_dim

    @property
    def sm_scale(self) -> float:
        """The attention softmax scale: ``query_pre_attn_scalar ** -0.5`` where set, else
        ``1 / sqrt(head_dim)`` (:class:`~deft.TreeAttention`'s default)."""
        if self.query_pre_attn_scalar is not None:
            return self.query_pre_attn_scalar ** -0.5
        return 1.0 / math.sqrt(self.head_dim)

    @property
    def context_text(self) -> str:
        """``the model's context of N`` and, where it was capped, what capped it."""
        return context_text(self.max_position_embeddings, self.context_cap)

    def capped(self, limit: int, cap: str) -> "LlamaConfig":
        """This config with its context at most ``limit``, ``cap`` naming why where it lowers it."""
        if limit >= self.max_position_embeddings:
            return self
        return replace(self, max_position_embeddings=limit, context_cap=cap)

    @property
    def fusable(self) -> bool:
        """Whether the fused CUDA kernels of :mod:`.fused` compute this decoder: SwiGLU,
        Llama's norms and one RoPE table (Gemma's features take the plain ops everywhere)."""
        return (self.hidden_act == "silu" and not self.norm_plus_one and not self.sandwich_norms
                and self.embed_scale == 1.0 and not self.local_rope_layers)

    @classmethod
    def from_hf_config(cls, config: Mapping[str, Any]) -> "LlamaConfig":
        """Build from a Hugging Face ``config.json`` dict with Llama's keys (the family's
        module has checked ``model_type`` and adapted other keys).

        A ``sliding_window`` caps ``max_position_embeddings`` (within the window full
        attention is exact), and so does LongRoPE's ``original_max_position_embeddings``.
        """
        for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                    "num_attention_heads"):
            if key not in config:
                raise ValueError(f"{key}: missing from the model config")
        max_pos = config.get("max_position_embeddings", 8192)
        theta, scaling = rope_from_hf(config.get("rope_parameters") or config.get("rope_scaling") or {},
                                      config.get("rope_theta"), max_pos)
        window = config.get("sliding_window")
        window = None if window is None else positive_int(window, "sliding_window")
        max_pos, cap = _longrope_context(scaling, max_pos)
        heads = config["num_attention_heads"]
        head_dim = config.get("head_dim") or 0
        factor = config.get("partial_rotary_factor", 1.0)
        if isinstance(factor, bool) or not isinstance(factor, Real) or not 0 < factor <= 1:
            raise ValueError(f"partial_rotary_factor: expected a number in (0, 1], got {factor!r}")
        # transformers' rotary dims: int(head_dim * factor)
        hd = head_dim or (config["hidden_size"] // heads if heads else 0)
        if factor != 1 and int(hd * factor) < 2:
            raise ValueError(f"partial_rotary_factor: rotates {int(hd * factor)} of a head's {hd} "
                             f"dims, expected at least 2")
        built = cls(
            vocab_size=config["vocab_size"],
            hidden_size=config["hidden_size"],
            intermediate_size=config["intermediate_size"],
            num_layers=config["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=config.get("num_key_value_heads") or heads,
            head_dim=head_dim,
            rotary_dim=int(hd * factor) if factor != 1 else 0,
            rms_norm_eps=config.get("rms_norm_eps", 1e-5),
            rope_theta=theta,
            rope_scaling=scaling,
            max_position_embeddings=max_pos,
            tie_word_embeddings=config.get("tie_word_embeddings", False),
            attention_bias=config.get("attention_bias", False),
            mlp_bias=config.get("mlp_bias", False),
            hidden_act=config.get("hidden_act", "silu"),
            context_cap=cap,
        )
        return built if window is None else built.capped(window, "its sliding window")

    @classmethod
    def from_gguf_metadata(
        cls, metadata: Mapping[str, Any], tie_word_embeddings: bool = True,
        short_factor: Sequence[float] | None = None,
    ) -> "LlamaConfig":
        """Build from GGUF key/values under ``{general.architecture}.`` (llama.cpp's keys,
        shared by the Llama-like architectures).

        GGUF has no tying flag: a file without ``output.weight`` is tied, so the loader
        passes ``tie_word_embeddings``. Llama 3.1 files carry their RoPE scaling as the
        ``rope_freqs`` tensor, which the loader sets as ``rope_freq_factors``; LongRoPE files
        as the ``rope_factors_short``/``_long`` tensors, the loader passing the short ones as
        ``short_factor``: the original context is then ``rope.scaling.original_context_length``
        (the context is capped there) and ``rope.scaling.attn_factor`` the cos/sin scale.
        """
        arch = metadata.get("general.architecture")
        if not isinstance(arch, str) or not arch:
            raise ValueError(f"general.architecture: expected a name, got {arch!r}")

        def num(key: str, default: Any = None, kind: type = int) -> Any:
            """``{arch}.{key}`` as an ``int`` (or ``float``); ``default`` if absent (None: required)."""
            name, value = f"{arch}.{key}", metadata.get(f"{arch}.{key}", default)
            if value is None:
                raise ValueError(f"{name}: missing from the GGUF metadata")
            number = isinstance(value, Real) and not isinstance(value, bool)
            if not (is_int(value) or kind is float and number):
                expected = "an integer" if kind is int else "a number"
                raise ValueError(f"{name}: expected {expected}, got {value!r}")
            return kind(value)

        hidden = num("embedding_length")
        heads = positive_int(num("attention.head_count"), f"{arch}.attention.head_count")
        head_dim = num("attention.key_length", 0) or (hidden // heads)
        rope_dim = num("rope.dimension_count", head_dim)  # partial rotary below head_dim
        if not 2 <= rope_dim <= head_dim or rope_dim % 2:
            raise ValueError(f"{arch}.rope.dimension_count: expected an even number from 2 to "
                             f"head_dim={head_dim}, got {rope_dim}")
        scaling_type = metadata.get(f"{arch}.rope.scaling.type", "none")
        scaling = None
        if not isinstance(scaling_type, str) or scaling_type not in ("none", "linear"):
            raise ValueError(f"{arch}.rope.scaling.type: expected 'none' or 'linear', got {scaling_type!r}")
        if scaling_type == "linear":
            scaling = RopeScaling("linear", num("rope.scaling.factor", 1.0, float))
        max_pos = num("context_length", 4096)
        if short_factor is not None:
            if scaling is not None:
                raise ValueError(f"{arch}.rope.scaling.type: expected 'none' with LongRoPE's factors, "
                                 f"got {scaling_type!r}")
            original = positive_int(num("rope.scaling.original_context_length"),
                                    f"{arch}.rope.scaling.original_context_length")
            attention = (num("rope.scaling.attn_factor", kind=float)
                         if f"{arch}.rope.scaling.attn_factor" in metadata else None)
            scaling = RopeScaling("longrope", max_pos / original, original_max_position_embeddings=original,
                                  short_factor=short_factor, attention_factor=attention)
        max_pos, cap = _longrope_context(scaling, max_pos)
        tokens = metadata.get("tokenizer.ggml.tokens", ())
        vocab = num("vocab_size", 0) or (len(tokens) if isinstance(tokens, list) else 0)
        return cls(
            vocab_size=vocab,
            hidden_size=hidden,
            intermediate_size=num("feed_forward_length"),
            num_layers=num("block_count"),
            num_heads=heads,
            num_kv_heads=num("attention.head_count_kv", heads),
            head_dim=head_dim,
            rotary_dim=0 if rope_dim == head_dim else rope_dim,
            rms_norm_eps=num("attention.layer_norm_rms_epsilon", 1e-5, float),
            rope_theta=num("rope.freq_base", 10000.0, float),
            rope_scaling=scaling,
            max_position_embeddings=max_pos,
            tie_word_embeddings=tie_word_embeddings,
            context_cap=cap,
        )
