"""What a decoding call is asked for and what it returns: :class:`SamplingParams`, :class:`GenerationResult`."""

from __future__ import annotations

from dataclasses import dataclass, field

from ..checks import int_at_least, int_in_range, is_int, real_number
from ..model.tokenizer import Tokenizer

__all__ = ["GenerationResult", "SamplingParams"]


@dataclass(frozen=True)
class SamplingParams:
    """How one sequence picks its tokens.

    ``temperature`` 0 is greedy (argmax); ``top_k`` 0 and ``top_p`` 1 are off; ``seed``
    makes sampling reproducible (one ``torch.Generator`` per call); ``stop_token_ids``
    ``None`` means the tokenizer's end-of-sequence ids. Generation stops after a stop
    token (kept in the output, as ``transformers`` does) or ``max_new_tokens`` tokens.
    """

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    max_new_tokens: int = 64
    stop_token_ids: frozenset[int] | None = None

    def __post_init__(self) -> None:
        real_number(self.temperature, "temperature", "a finite number >= 0", lambda t: t >= 0)
        int_at_least(self.top_k, "top_k", 0)
        real_number(self.top_p, "top_p", "a number in (0, 1]", lambda p: 0 < p <= 1)
        if self.seed is not None:  # what torch.Generator.manual_seed takes
            int_in_range(self.seed, "seed", -(1 << 63), (1 << 64) - 1)
        int_at_least(self.max_new_tokens, "max_new_tokens", 1)
        stop = self.stop_token_ids
        if stop is not None:
            try:
                ids = frozenset(stop)
            except TypeError:
                raise ValueError(f"stop_token_ids: expected a set of token ids or None, got {stop!r}") from None
            if any(not is_int(i) or i < 0 for i in ids):
                raise ValueError(f"stop_token_ids: expected non-negative integers, got {sorted(ids, key=str)}")
            object.__setattr__(self, "stop_token_ids", frozenset(int(i) for i in ids))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def stop_ids(self, tokenizer: Tokenizer) -> frozenset[int]:
        """``stop_token_ids``, or the tokenizer's EOS ids when ``None``."""
        return tokenizer.eos_token_ids if self.stop_token_ids is None else self.stop_token_ids


@dataclass
class GenerationResult:
    """One generated sequence: its new token ids (stop token included), text and score.

    ``score`` is strategy-specific: the sum of the model's log-probabilities of the
    generated tokens for ``generate``/``sample``, the length-penalised beam score for
    ``beam_search``. ``stats`` holds ``finish_reason`` (``"stop"`` or ``"length"``) and
    the call's timing figures.
    """

    token_ids: list[int]
    text: str
    score: float | None = None
    stats: dict = field(default_factory=dict)
