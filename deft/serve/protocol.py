"""OpenAI's request bodies (its field names), DeFT's extras, and its error object.

Unknown fields are ignored (clients send many); a known field of the wrong type or out of
range is a 400 naming it. Extras: ``top_k``, ``stop_token_ids``, ``use_beam_search`` with
``length_penalty`` and ``early_stopping`` (vLLM's names), and ``speculative``.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from ..engine.beams import MAX_LENGTH_PENALTY

__all__ = ["ChatRequest", "CompletionRequest", "Message", "SpeculativeOptions", "error_body"]

MAX_N = 64


class SpeculativeOptions(BaseModel):
    """``drafter``: ``"ngram"`` (prompt lookup) or ``"model"`` (the server's ``--draft-model``);
    ``tree``: Medusa choice paths, or a top-k shape ``{"k", "depth", "width"}``."""

    model_config = ConfigDict(extra="forbid")
    drafter: Literal["ngram", "model"] = "ngram"
    tree: list[list[int]] | dict[str, int] | None = None


class _Sampling(BaseModel):
    model_config = ConfigDict(extra="ignore")
    model: str
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=0)
    seed: int | None = Field(None, ge=-(1 << 63), lt=1 << 64)
    n: int = Field(1, ge=1, le=MAX_N)
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    stream: bool = False
    stream_options: dict[str, Any] | None = None
    presence_penalty: float = Field(0.0, ge=0, le=0)
    frequency_penalty: float = Field(0.0, ge=0, le=0)
    use_beam_search: bool = False
    length_penalty: float = Field(1.0, ge=-MAX_LENGTH_PENALTY, le=MAX_LENGTH_PENALTY, allow_inf_nan=False)
    early_stopping: bool | Literal["never"] = False
    speculative: SpeculativeOptions | None = None

    def stop_strings(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])


class CompletionRequest(_Sampling):
    """``POST /v1/completions``: ``prompt`` is text, token ids, or a list of either."""

    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = Field(None, ge=0, le=20)
    best_of: int | None = Field(None, ge=1, le=MAX_N)
    echo: bool = Field(False, le=False)


class Message(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[dict[str, Any]]

    def text(self) -> str:
        """The content as text (the text parts of a list joined)."""
        if isinstance(self.content, str):
            return self.content
        parts = []
        for i, part in enumerate(self.content):
            if part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise ValueError(f"messages: content[{i}]: expected a text part, got {part.get('type')!r}")
            parts.append(part["text"])
        return "".join(parts)


class ChatRequest(_Sampling):
    """``POST /v1/chat/completions``: ``messages`` rendered by the model's chat template."""

    messages: list[Message] = Field(min_length=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    best_of: int | None = Field(None, ge=1, le=MAX_N)
    max_completion_tokens: int | None = Field(None, ge=1)


def error_body(message: str, type_: str, param: str | None = None, code: str | None = None) -> dict:
    """OpenAI's error object."""
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}
