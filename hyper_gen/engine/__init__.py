"""In-flight batching engine: per-request sampling and a thread-safe, async-friendly request API.

``Engine`` (engine.py) is the facade over one ``EngineCore`` (core.py), which applies every call
as a message (messages.py) at a step boundary and steps a paged batch that requests join and leave
at every step, with the cache and scheduler settings of an ``EngineConfig`` (config.py, vLLM's
names); ``SamplingParams`` (params.py) are vLLM's per-request
settings; streams (stream.py) carry ``CompletionChunk``s to any thread or event loop and end in
a ``RequestOutput`` (outputs.py). The OpenAI server (``hyper_gen.server``) and the offline JSONL
job (``hyper-gen generate --input``) run on it.
"""

from .config import EngineConfig
from .engine import Engine, EngineDeadError
from .outputs import ChoiceOutput, CompletionChunk, RequestOutput
from .params import SamplingParams
from .stream import RequestStream

__all__ = [
    "Engine",
    "EngineDeadError",
    "EngineConfig",
    "SamplingParams",
    "CompletionChunk",
    "ChoiceOutput",
    "RequestOutput",
    "RequestStream",
]
