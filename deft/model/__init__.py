"""Models over the tree KV cache: the decoder contract, registered families (Llama, Mistral,
Qwen2, Qwen3, Phi-3, Gemma 3), config, loaders, tokenizer.

``model, tok = load_model()`` loads the default SmolLM2-135M-Instruct GGUF;
``load_random("random:llama-3-8b", "cuda")`` builds a random-weight model of known shapes
(:mod:`.synthetic`). See ``docs/model.md`` for the step interface.
"""

from .config import LlamaConfig, RopeScaling
from .contract import DecoderModel, check_decoder
from .families import Family, families, register_family, unregister_family
from .llama import LlamaModel
from .loader import load_model
from .synthetic import is_random_spec, load_random
from .tokenizer import Tokenizer

__all__ = ["DecoderModel", "Family", "LlamaConfig", "LlamaModel", "RopeScaling", "Tokenizer",
           "check_decoder", "families", "is_random_spec", "load_model", "load_random",
           "register_family", "unregister_family"]
