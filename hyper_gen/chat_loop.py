"""``chat(model, tokenizer)``: a typed conversation with a model, called on every rank of its job.

Rank 0 reads the lines (``input=``, default stdin) and writes the transcript (``output=``, default
stdout); the other ranks follow its turns (``chat_session.ChatSession``), so every rank runs the
same forwards and every rank returns together when rank 0's input ends (EOF or an exit word). A
person may think as long as they like between lines: rank 0 keeps the other ranks' waits short.
"""

from __future__ import annotations

import builtins
import sys
from typing import Callable, List, Optional

from .chat_session import ChatSession, MessageTooLong

EXIT_WORDS = ("exit", "quit")
PROMPT = "User: "


def read_stdin_line() -> Optional[str]:
    """The default ``input``: the next line of stdin, None at its end."""
    try:
        return builtins.input()
    except EOFError:
        return None


def chat(
    model,
    tokenizer,
    config=None,
    *,
    input: Optional[Callable[[], Optional[str]]] = None,
    output=None,
    system: Optional[str] = None,
    exit_words=EXIT_WORDS,
    timeout_s=None,
    **overrides,
) -> List[dict]:
    """Chat with ``model`` until the input ends; call it on every rank of the job (or in one process).

    ``input``: on rank 0, a callable returning the next line, or None to end (default: stdin).
    ``output``: on rank 0, a text stream for the transcript (default: stdout): ``User: `` before each
    line (the line itself too when ``input`` is not stdin, which the terminal echoes), then
    ``Assistant: `` and the reply as it is generated. Blank lines are skipped; a line equal to one of
    ``exit_words`` (any case) ends the chat like EOF; a message the context cannot hold is refused
    with a note and the conversation goes on. ``system``, ``timeout_s``, ``config`` and ``overrides``:
    as :class:`ChatSession`. Returns the conversation kept (the same on every rank).
    """
    if input is not None and not callable(input):
        raise TypeError(f"input must be a callable returning the next line or None, got {type(input).__name__}")
    words = {w.strip().lower() for w in ([exit_words] if isinstance(exit_words, str) else exit_words or ())}
    session = ChatSession(model, tokenizer, config, system=system, timeout_s=timeout_s, **overrides)
    if session.rank != 0:
        return session.follow()
    out = output if output is not None else sys.stdout
    read, echo = (input, True) if input is not None else (read_stdin_line, False)
    try:
        while True:
            text = _next_message(read, out, echo, words)
            if text is None:
                break
            try:
                reply = session.send(text)
            except MessageTooLong as error:
                _write(out, f"({error}; try a shorter one)\n")
                continue
            _write(out, "Assistant: ")
            for piece in reply:
                _write(out, piece)
            _write(out, "\n")
    finally:
        session.close()  # every rank leaves, whatever ended the input (an exception from it too)
    _write(out, "\n")
    return session.history


def _next_message(read, out, echo, exit_words) -> Optional[str]:
    """The next non-blank line, None at the end of the input or an exit word. A line that is not
    UTF-8 text (bytes a terminal could not decode) is refused with a note, as an overlong one."""
    while True:
        _write(out, PROMPT)
        line = read()
        if line is None:
            return None
        if not isinstance(line, str):
            raise TypeError(f"input() must return a string or None, got {type(line).__name__}")
        line = line.rstrip("\r\n")
        try:
            line.encode("utf-8")
        except UnicodeEncodeError as exc:
            _write(out, f"(message is not UTF-8 text: {line[exc.start]!r} at character {exc.start}; try again)\n")
            continue
        if echo:
            _write(out, line + "\n")
        if line.strip():
            return None if line.strip().lower() in exit_words else line


def _write(out, text: str) -> None:
    out.write(text)
    out.flush()
