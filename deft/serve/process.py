"""The server process's shutdown: on SIGINT or SIGTERM, drain the scheduler, then stop uvicorn.

Draining takes no new request (503), lets the running ones finish for a grace period, then
ends the rest with an error their clients can read (a JSON error, or an error event and
``[DONE]``). Only then is uvicorn told to exit (it lets answers under way finish), so no
request is cut mid-answer.
"""

from __future__ import annotations

import threading
import time
from types import FrameType
from typing import Callable

import uvicorn

from .scheduler import Scheduler

__all__ = ["DrainingServer"]

_POLL_S = 0.05
_ABORT_S = 10.0  # for the scheduler to end the jobs it was told to end (a step or so)


class DrainingServer(uvicorn.Server):
    """``uvicorn.Server`` over ``scheduler``'s app: the first signal drains, giving running
    requests ``grace`` seconds; a second one stops at once."""

    def __init__(self, config: uvicorn.Config, scheduler: Scheduler, grace: float) -> None:
        super().__init__(config)
        self.scheduler, self.grace, self.draining = scheduler, grace, False

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self.draining:
            super().handle_exit(sig, frame)
            return
        self.draining = True
        threading.Thread(target=self._drain, name="deft-drain", daemon=True).start()

    def _drain(self) -> None:
        s = self.scheduler
        s.close()
        _until(lambda: s.idle, self.grace)
        if not s.idle:
            s.abort()
            _until(lambda: s.idle, _ABORT_S)
        self.should_exit = True


def _until(done: Callable[[], bool], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not done() and time.monotonic() < deadline:
        time.sleep(_POLL_S)
