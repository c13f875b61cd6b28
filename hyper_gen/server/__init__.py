"""The OpenAI-compatible HTTP server (FastAPI + uvicorn) on the in-flight batching engine.

- ``protocol``: request / response bodies with OpenAI's field names (unknown fields are 400s);
  ``dialects``: the fields SGLang's and vLLM's routers add, honoured or accepted at neutral values;
  ``texts``: a choice's text decoded here for ``no_stop_trim`` / ``skip_special_tokens: false``
- ``errors``: OpenAI's error schema; ``body``: a request body read and checked (content type,
  size, JSON, surrogates, strict types); ``params``: a request as the engine's ``SamplingParams``
- ``prompts``: prompt token ids (text, ids, chat template); ``logprobs``: OpenAI's two formats
- ``streams``: several engine streams as one SSE response, cancelled when the client leaves,
  interrupted (a 503 / a last error event) when the server stops
- ``completions``, ``chat``: the two generating endpoints; ``state``: what they share
- ``info``: SGLang's ``/server_info`` and ``/model_info``; ``render``: vLLM's tokenize-only
  ``/v1/completions/render`` and ``/v1/chat/completions/render`` (what the routers read)
- ``metrics``: ``GET /metrics``, the engine's ``stats()`` in Prometheus' text format (vLLM's names)
- ``app``: ``create_app(engine, tokenizer, model_name)``; ``launch``: uvicorn, signals, ranks,
  and ``BackgroundServer`` (the server on a thread of a program that keeps its model)

Needs the ``serve`` extra (``pip install 'hyper_gen[serve]'``); ``hyper-gen serve`` runs it.
"""

from .app import create_app
from .launch import BackgroundServer

__all__ = ["create_app", "BackgroundServer"]
