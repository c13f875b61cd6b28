"""The ``hyper-gen`` command line: ``main`` parses and dispatches to the subcommands
(``generate``, ``chat``, ``serve``; ``bench`` lives in ``hyper_gen.bench``), which share ``common``
(flags, loading) and ``hyper_gen.jobs`` (user errors, the tokenizer, the JSONL runner).

Importing it imports no framework: a backend is imported when a command picks one.
"""

from .main import build_parser, entry_point, main

__all__ = ["build_parser", "entry_point", "main"]
