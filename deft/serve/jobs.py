"""What the HTTP layer hands the scheduler (:class:`Job`) and what comes back (events).

A job is one prompt decoded into ``n`` choices. The scheduler thread turns each choice's
new tokens into text deltas (:class:`ChoiceText`: incomplete UTF-8 and a possible start
of a stop string are held back, a matched stop string ends the choice) and posts
:class:`Delta` and :class:`End` events to the job's asyncio queue, on the HTTP loop.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any

from ..engine import SamplingParams
from ..engine.decoding import Request
from ..model.tokenizer import Tokenizer

__all__ = ["ChoiceText", "Delta", "End", "Job", "TokenLogprob"]


@dataclass
class TokenLogprob:
    """One generated token's log-probability, with the ``top`` alternatives asked for."""

    token: int
    logprob: float
    top: list[tuple[int, float]]


@dataclass
class Delta:
    """New text of choice ``index`` (its tokens' log-probabilities), and its finish reason
    once it has ended."""

    index: int
    text: str
    logprobs: list[TokenLogprob]
    finish_reason: str | None = None


@dataclass
class End:
    """The job is over: ``error`` (an HTTP status and a message) or its token counts."""

    prompt_tokens: int = 0
    completion_tokens: int = 0
    error: tuple[int, str] | None = None


@dataclass(eq=False)
class Job:
    """One prompt's request. ``kind``: ``"sample"``, ``"beam"`` or ``"speculative"`` (all in
    the batch; ``options`` holds the beam or draft settings). ``best_of`` > ``n`` samples
    that many and keeps the ``n`` most likely (beam search: ``best_of`` beams).
    ``top_logprobs`` ``None``: no log-probabilities."""

    prompt: list[int]
    n: int
    params: SamplingParams
    stop: list[str]
    events: asyncio.Queue
    loop: asyncio.AbstractEventLoop
    top_logprobs: int | None = None
    best_of: int = 1
    kind: str = "sample"
    options: dict[str, Any] = field(default_factory=dict)
    base_index: int = 0  # index of the job's first choice in the response
    arrival: float = field(default_factory=time.monotonic)
    started_at: float | None = None  # when the batch first ran it
    request: Request | None = None
    choices: list[ChoiceText] = field(default_factory=list)
    last_token_at: float | None = None
    finished: bool = False

    def post(self, event: Delta | End) -> None:
        """Put ``event`` on the job's queue from any thread (dropped once the loop is closed)."""
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, (self, event))
        except RuntimeError:
            pass


class ChoiceText:
    """The text of one choice so far, as deltas: what is sent is never taken back.

    Each update decodes only the tokens since the last point where the text was whole (no
    incomplete UTF-8 at its end), next to the ones before it for context, as streaming
    servers do: a choice's text is built piece by piece, never decoded whole again. It
    keeps the text from just before the last ``max(len(stop))`` characters sent on: what a
    stop string may still match.
    """

    def __init__(self, tokenizer: Tokenizer, stop: list[str]) -> None:
        self.tokenizer, self.stop = tokenizer, stop
        self.seen = 0  # tokens turned into text
        self.ended = False
        self._longest = max((len(s) for s in stop), default=0)
        self._sent = 0  # characters sent
        self._context = self._read = 0  # tokens [context, read) decode to the text's whole end
        self._at = 0  # where ``_text`` starts in the choice's text
        self._text = ""  # the text of tokens [:read], from ``_at`` on

    def update(self, tokens: list[int], final: bool) -> tuple[str, int, bool]:
        """The text delta for ``tokens`` (all the choice's tokens so far), how many new
        tokens it covers, and whether a stop string ended the choice."""
        if len(tokens) <= self.seen and not final:
            return "", 0, False
        new = max(0, len(tokens) - self.seen)
        self.seen = max(self.seen, len(tokens))
        decode, start, read = self.tokenizer.decode, self._context, self._read
        known = decode(tokens[start:read], skip_special_tokens=True)
        now = decode(tokens[start:], skip_special_tokens=True)
        text = self._text + now[len(known):]  # the choice's text from ``_at`` on
        sent = self._sent - self._at
        if not now.endswith("\ufffd"):  # whole: the next update decodes from here
            self._text, self._context, self._read = text, read, len(tokens)
        cut = self._stop_at(text)
        if cut is not None:
            self.ended = True
            return self._send(text[sent:cut] if cut > sent else ""), new, True
        if final:
            self.ended = True
            return self._send(text[sent:]), new, False
        safe = len(text.rstrip("\ufffd"))  # an incomplete UTF-8 sequence decodes to U+FFFD
        safe -= max((k for s in self.stop for k in range(1, min(len(s) - 1, safe) + 1)
                     if text[safe - k:safe] == s[:k]), default=0)  # may begin a stop string
        return self._send(text[sent:safe] if safe > sent else ""), new, False

    def _send(self, delta: str) -> str:
        """Count ``delta`` sent; keep the text from ``_longest`` characters before the end of
        what is sent (and all that is not), within what is whole."""
        self._sent += len(delta)
        drop = min(max(0, self._sent - self._longest) - self._at, len(self._text))
        if drop > 0:
            self._text, self._at = self._text[drop:], self._at + drop
        return delta

    def _stop_at(self, text: str) -> int | None:
        """Where the first stop string in ``text`` (the choice's text from ``_at`` on) starts,
        looking from ``_longest`` characters before the end of what is sent."""
        start = max(0, self._sent - self._longest) - self._at
        found = [i for i in (text.find(s, start) for s in self.stop) if i >= 0]
        return min(found) if found else None
