"""The inference engine: one forward per step over a tree KV cache, and decoding strategies.

``TreeEngine(model, tokenizer)`` runs steps; ``generate``, ``sample``, ``beam_search``,
``tree_search`` and ``replay_trace`` drive it. See ``docs/engine.md``.
"""

from .core import GenerationResult, SamplingParams, TreeEngine
from .sampling import Sampler, probabilities

__all__ = ["GenerationResult", "Sampler", "SamplingParams", "TreeEngine", "probabilities"]
