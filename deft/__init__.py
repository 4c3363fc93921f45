"""DeFT: exact, IO-aware attention for tree-structured LLM decoding."""

from .attention import TreeAttention, tree_attention
from .cache import CacheFullError, KVPool, KVSpec, TreeKVCache
from .layout import TreeLayout
from .merge import merge_state, merge_state_in_place, merge_states
from .ops import Capacity, CapacityError, backend_names, register_backend
from .plan import PLAN_KINDS, TreePlan, make_plan

__version__ = "0.1.0"

__all__ = [
    "CacheFullError",
    "Capacity",
    "CapacityError",
    "KVPool",
    "KVSpec",
    "PLAN_KINDS",
    "TreeAttention",
    "TreeKVCache",
    "TreeLayout",
    "TreePlan",
    "backend_names",
    "make_plan",
    "merge_state",
    "merge_state_in_place",
    "merge_states",
    "register_backend",
    "tree_attention",
]
