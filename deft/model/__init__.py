"""Llama-family model runtime over the tree KV cache: config, model, loaders, tokenizer.

``model, tok = load_model()`` loads the default SmolLM2-135M-Instruct GGUF;
``load_random("random:llama-3-8b", "cuda")`` builds a random-weight model of known shapes
(:mod:`.synthetic`). See ``docs/model.md`` for the step interface.
"""

from .config import LlamaConfig, RopeScaling
from .llama import LlamaModel
from .loader import load_model
from .synthetic import is_random_spec, load_random
from .tokenizer import Tokenizer

__all__ = ["LlamaConfig", "LlamaModel", "RopeScaling", "Tokenizer", "is_random_spec", "load_model",
           "load_random"]
