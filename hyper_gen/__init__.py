"""hyper_gen: one LLM ``generate()`` for PyTorch and MindSpore models.

Importing this package imports neither torch nor mindspore; a backend is picked from the
objects ``generate`` is handed.
"""

from .cache import DynamicCache, KVCache, StaticCache
from .chat_loop import chat
from .chat_session import ChatSession
from .config import GenerationConfig
from .generation import generate
from .grammar import StructuredOutputs
from .mixin import GenerateMixin
from .outputs import GenerateOutput
from .scoring import score

__all__ = [
    "generate",
    "score",
    "chat",
    "ChatSession",
    "GenerationConfig",
    "GenerateOutput",
    "StructuredOutputs",
    "KVCache",
    "StaticCache",
    "DynamicCache",
    "GenerateMixin",
    "load_model",
    "update_weights",
]
__version__ = "0.1.0"


def load_model(*args, **kwargs):
    """Load an HF Qwen3.5 checkpoint as a native model (see ``hyper_gen.models.loading.load_model``)."""
    from .models.loading import load_model as _load_model

    return _load_model(*args, **kwargs)


def update_weights(model, weights) -> int:
    """Write a trainer's ``(name, tensor)`` pairs (HF checkpoint names) into a model from ``load_model``,
    all or nothing (see ``hyper_gen.models.weight_update.update_weights``); returns how many were applied."""
    from .models.weight_update import update_weights as _update_weights

    return _update_weights(model, weights)
