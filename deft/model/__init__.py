"""Llama-family model runtime over the tree KV cache: config, model, loaders, tokenizer.

``model, tok = load_model()`` loads the default SmolLM2-135M-Instruct GGUF; see
``docs/model.md`` for the step interface.
"""

from .config import LlamaConfig, RopeScaling
from .llama import LlamaModel
from .loader import load_model
from .tokenizer import Tokenizer

__all__ = ["LlamaConfig", "LlamaModel", "RopeScaling", "Tokenizer", "load_model"]
