"""Streamers with HF's protocol (``put(token_ids)`` / ``end()``), for any framework.

generate() hands streamers host numpy arrays, so HF's own ``TextStreamer`` and
``TextIteratorStreamer`` work on MindSpore models too. These versions need only a tokenizer with
``decode(ids, skip_special_tokens=...)`` (an HF tokenizer or ``tokenizers.Tokenizer``) and emit
text as soon as it is stable: a multi-byte character split across tokens decodes to U+FFFD until
its last byte arrives, and is held back until then.
"""

from __future__ import annotations

import queue
import sys
import threading
from typing import Optional

import numpy as np

from .registry import thread_initializer

_INCOMPLETE = "\ufffd"


class TextStreamer:
    """Prints decoded text to stdout (or ``file``) as it becomes stable; batch size 1."""

    def __init__(self, tokenizer, skip_prompt: bool = False, file=None, **decode_kwargs):
        self.tokenizer = tokenizer
        self.skip_prompt = skip_prompt
        self.file = file
        self.decode_kwargs = decode_kwargs
        self._tokens: list = []
        self._printed = 0
        self._prompt_pending = True

    def put(self, value) -> None:
        ids = np.asarray(value)
        if ids.ndim > 1:
            if ids.shape[0] > 1:
                raise ValueError(
                    f"{type(self).__name__} supports batch size 1, got {ids.shape[0]} rows "
                    "(use generate(..., on_tokens=...) for batches)"
                )
            ids = ids[0]
        if self._prompt_pending:
            self._prompt_pending = False
            if self.skip_prompt:
                return
        self._tokens.extend(int(t) for t in np.atleast_1d(ids))
        text = self.tokenizer.decode(self._tokens, **self.decode_kwargs)
        stable = len(text.rstrip(_INCOMPLETE))
        if stable > self._printed:
            self.on_text(text[self._printed : stable])
            self._printed = stable

    def end(self) -> None:
        text = self.tokenizer.decode(self._tokens, **self.decode_kwargs) if self._tokens else ""
        self.on_text(text[self._printed :], stream_end=True)
        self._tokens, self._printed, self._prompt_pending = [], 0, True

    def on_text(self, text: str, stream_end: bool = False) -> None:
        out = self.file or sys.stdout
        print(text, end="\n" if stream_end else "", file=out, flush=True)


class TextIteratorStreamer(TextStreamer):
    """Iterate the text in the caller while generate() runs in another thread.

    ``timeout`` (seconds) bounds each wait, raising ``queue.Empty`` instead of hanging forever.
    """

    _STOP = object()

    def __init__(self, tokenizer, skip_prompt: bool = False, timeout: Optional[float] = None, **decode_kwargs):
        super().__init__(tokenizer, skip_prompt, **decode_kwargs)
        self.text_queue: queue.Queue = queue.Queue()
        self.timeout = timeout

    def on_text(self, text: str, stream_end: bool = False) -> None:
        if text:
            self.text_queue.put(text, timeout=self.timeout)
        if stream_end:
            self.text_queue.put(self._STOP, timeout=self.timeout)

    def __iter__(self):
        return self

    def __next__(self) -> str:
        value = self.text_queue.get(timeout=self.timeout)
        if value is self._STOP:
            raise StopIteration
        return value


def generate_in_thread(generate_fn, *args, **kwargs) -> threading.Thread:
    """Start ``generate_fn(*args, **kwargs)`` in a daemon thread (pair with TextIteratorStreamer)."""
    setup = thread_initializer()  # this thread's framework settings (torch's thread count) on the new one

    def run():
        setup()
        generate_fn(*args, **kwargs)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread
