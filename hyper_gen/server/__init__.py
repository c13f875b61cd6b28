"""The OpenAI-compatible HTTP server (FastAPI + uvicorn) on the in-flight batching engine.

- ``protocol``: request / response bodies with OpenAI's field names (unknown fields are 400s)
- ``errors``: OpenAI's error schema; ``body``: a request body read and checked (content type,
  size, JSON, surrogates, strict types); ``params``: a request as the engine's ``SamplingParams``
- ``prompts``: prompt token ids (text, ids, chat template); ``logprobs``: OpenAI's two formats
- ``streams``: several engine streams as one SSE response, cancelled when the client leaves,
  interrupted (a 503 / a last error event) when the server stops
- ``completions``, ``chat``: the two generating endpoints; ``state``: what they share
- ``metrics``: ``GET /metrics``, the engine's ``stats()`` in Prometheus' text format (vLLM's names)
- ``app``: ``create_app(engine, tokenizer, model_name)``; ``launch``: uvicorn, signals, ranks,
  and ``BackgroundServer`` (the server on a thread of a program that keeps its model)

Needs the ``serve`` extra (``pip install 'hyper_gen[serve]'``); ``hyper-gen serve`` runs it.
"""

from .app import create_app
from .launch import BackgroundServer

__all__ = ["create_app", "BackgroundServer"]
