"""Tokenizer wrapper: a ``tokenizers.Tokenizer``, the stop tokens and the chat template."""

from __future__ import annotations

import json
from datetime import datetime
from functools import cached_property
from typing import Iterable, Mapping, Sequence

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as _Backend

__all__ = ["Tokenizer", "END_OF_TURN_TOKENS"]

# Special tokens that end a turn in common chat formats (llama.cpp's end-of-generation
# list); each one present in a vocabulary as a special token is a stop token.
END_OF_TURN_TOKENS = (
    "<|endoftext|>", "<|im_end|>", "<|eot_id|>", "<|eom_id|>", "<|end|>", "<end_of_turn>", "<EOT>",
)

Message = Mapping[str, str]


class Tokenizer:
    """Text <-> token ids, stop tokens and chat formatting for one model.

    Parameters
    ----------
    backend:
        The ``tokenizers.Tokenizer``; its post-processor adds BOS where the model wants it.
    eos_token_ids:
        Ids that end generation (the model's EOS plus end-of-turn tokens).
    chat_template:
        The model's Jinja chat template, or ``None``.
    bos_token, eos_token:
        Token texts the template may refer to.
    """

    def __init__(
        self,
        backend: _Backend,
        eos_token_ids: Iterable[int],
        chat_template: str | None = None,
        bos_token: str | None = None,
        eos_token: str | None = None,
    ) -> None:
        self.backend = backend
        self.eos_token_ids = frozenset(int(i) for i in eos_token_ids)
        self.chat_template = chat_template
        self.bos_token, self.eos_token = bos_token, eos_token

    def __repr__(self) -> str:
        return (
            f"Tokenizer(vocab_size={self.vocab_size}, eos_token_ids={sorted(self.eos_token_ids)}, "
            f"chat_template={self.chat_template is not None})"
        )

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text`` (with BOS if the model adds one and ``add_special_tokens``).
        Other threads run meanwhile (the batch call releases the GIL; a server's event loop
        goes on while a long prompt is tokenised)."""
        if not isinstance(text, str):
            raise TypeError(f"text: expected a str, got {type(text).__name__}")
        return self.backend.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        """Text of ``ids``."""
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_id(self, token: str) -> int | None:
        """Id of the token spelled ``token``, or ``None``."""
        return self.backend.token_to_id(token)

    def render_chat(self, messages: str | Sequence[Message], add_generation_prompt: bool = True) -> str:
        """The chat template applied to ``messages`` (a str is one user message)."""
        if self.chat_template is None:
            raise ValueError("apply_chat_template: this model has no chat template")
        if isinstance(messages, str):
            messages = [{"role": "user", "content": messages}]
        try:
            return self._template.render(
                messages=list(messages), add_generation_prompt=add_generation_prompt,
                bos_token=self.bos_token or "", eos_token=self.eos_token or "",
            )
        except jinja2.TemplateError as exc:
            raise ValueError(f"apply_chat_template: the chat template failed: {exc}") from exc

    def apply_chat_template(
        self, messages: str | Sequence[Message], add_generation_prompt: bool = True
    ) -> list[int]:
        """Token ids of the rendered chat (the template writes any BOS itself)."""
        return self.encode(self.render_chat(messages, add_generation_prompt), add_special_tokens=False)

    @cached_property
    def _template(self) -> jinja2.Template:
        env = ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
        )

        def raise_exception(message: str) -> None:
            raise jinja2.TemplateError(message)

        env.filters["tojson"] = lambda x, indent=None: json.dumps(x, ensure_ascii=False, indent=indent)
        env.globals["raise_exception"] = raise_exception
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        return env.from_string(self.chat_template)


def end_of_turn_ids(backend: _Backend, special: Iterable[str]) -> set[int]:
    """Ids of the :data:`END_OF_TURN_TOKENS` among the ``special`` token texts."""
    special = set(special)
    ids = (backend.token_to_id(t) for t in END_OF_TURN_TOKENS if t in special)
    return {i for i in ids if i is not None}
