"""The inference engine: one forward per step over a tree KV cache, and decoding strategies.

``TreeEngine(model, tokenizer, EngineConfig(...))`` (:mod:`.core`) builds each step as a
value (:mod:`.step`) that its device's :class:`~.runner.ModelRunner` runs; the strategies of
:mod:`.strategies` drive it: ``generate``, ``sample``, ``beam_search``, ``tree_search``,
``speculative_generate`` (with the drafters of :mod:`.drafters` and the draft-tree shapes
of :mod:`.draft_trees`) and ``replay_trace``. ``SamplingParams`` and ``GenerationResult``
are in :mod:`.params`. See ``docs/engine.md``.
"""

from .config import EngineConfig
from .core import TreeEngine
from .draft_trees import TopKShape, TreeShape, as_shape
from .drafters import DraftJob, Drafter, ModelDrafter, NgramDrafter
from .params import GenerationResult, SamplingParams
from .sampling import Sampler, probabilities
from .strategies import (
    Expansion,
    ReplayReport,
    Thought,
    beam_search,
    generate,
    load_trace,
    replay_trace,
    sample,
    speculative_generate,
    tree_search,
)

__all__ = [
    "DraftJob",
    "Drafter",
    "EngineConfig",
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
