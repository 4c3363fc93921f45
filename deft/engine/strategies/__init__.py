"""Decoding strategies over a :class:`~deft.engine.TreeEngine`, one module each.

``generate``/``sample`` (:mod:`.generate`), ``beam_search`` (:mod:`.beam`), ``tree_search``
(:mod:`.tree_search`), ``speculative_generate`` (:mod:`.speculative`) and ``replay_trace``
(:mod:`.replay`); all re-exported by :mod:`deft.engine`.
"""

from .beam import beam_search
from .generate import generate, sample
from .replay import ReplayReport, load_trace, replay_trace
from .speculative import accept_greedy, accept_sampled, speculative_generate
from .tree_search import Expansion, Thought, tree_search

__all__ = [
    "Expansion",
    "ReplayReport",
    "Thought",
    "accept_greedy",
    "accept_sampled",
    "beam_search",
    "generate",
    "load_trace",
    "replay_trace",
    "sample",
    "speculative_generate",
    "tree_search",
]
