"""The inference engine: one forward per step over a tree KV cache, and decoding strategies.

``TreeEngine(model, tokenizer)`` runs steps; ``generate``, ``sample``, ``beam_search``,
``tree_search`` and ``replay_trace`` drive it (speculative decoding lives in
``deft.engine.speculative``). See ``docs/engine.md``.
"""

from .beam import beam_search
from .core import GenerationResult, SamplingParams, TreeEngine
from .replay import ReplayReport, replay_trace
from .sampling import Sampler, probabilities
from .strategies import generate, sample
from .tree_search import Expansion, Thought, tree_search

__all__ = [
    "Expansion",
    "GenerationResult",
    "ReplayReport",
    "Sampler",
    "SamplingParams",
    "Thought",
    "TreeEngine",
    "beam_search",
    "generate",
    "probabilities",
    "replay_trace",
    "sample",
    "tree_search",
]
