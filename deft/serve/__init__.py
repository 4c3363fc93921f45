"""``deft serve``: an OpenAI-compatible HTTP server over one :class:`~deft.engine.TreeEngine`.

:class:`Scheduler` (one thread owns the engine: continuous batching, the prefix cache
across requests), :func:`create_app` (the FastAPI routes), :class:`Metrics` (Prometheus)
and :class:`DrainingServer` (uvicorn, shut down cleanly). Needs the ``serve`` extra
(fastapi, uvicorn, prometheus-client). See ``docs/serve.md``.
"""

from .app import create_app
from .metrics import Metrics
from .prefix_cache import PrefixCache
from .process import DrainingServer
from .scheduler import Scheduler

__all__ = ["DrainingServer", "Metrics", "PrefixCache", "Scheduler", "create_app"]
