"""The inference engine: one forward per step over a tree KV cache, and decoding strategies.

``TreeEngine(model, tokenizer)`` runs steps; ``generate``, ``sample``, ``beam_search``,
``tree_search`` and ``replay_trace`` drive it (and ``speculative_generate``). See ``docs/engine.md``.
"""

from .beam import beam_search
from .core import GenerationResult, SamplingParams, TreeEngine
from .drafters import DraftJob, Drafter, ModelDrafter, NgramDrafter
from .replay import ReplayReport, load_trace, replay_trace
from .sampling import Sampler, probabilities
from .speculative import speculative_generate
from .strategies import generate, sample
from .tree_search import Expansion, Thought, tree_search
from .trees import TopKShape, TreeShape, as_shape

__all__ = [
    "DraftJob",
    "Drafter",
    "Expansion",
    "GenerationResult",
    "ModelDrafter",
    "NgramDrafter",
    "ReplayReport",
    "Sampler",
    "SamplingParams",
    "Thought",
    "TopKShape",
    "TreeEngine",
    "TreeShape",
    "as_shape",
    "beam_search",
    "generate",
    "load_trace",
    "probabilities",
    "replay_trace",
    "sample",
    "speculative_generate",
    "tree_search",
]
