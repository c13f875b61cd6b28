"""argparse types of the bench flags: a bad value is a one-line usage error (exit 2) before any work."""

from __future__ import annotations

import argparse
import os
import re

from hyper_gen import kernel_plan

_LITERAL = re.compile(r"``(.+?)``", re.S)  # a reST inline literal in a docstring
CACHE_DIR = os.path.join(os.path.expanduser("~"), ".cache", "hyper_gen_bench")  # random-weight checkpoints


def positive(text: str) -> int:
    """An argparse type: an integer >= 1 (a count, a size, a length)."""
    value = _integer(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def non_negative(text: str) -> int:
    """An argparse type: an integer >= 0 (0 meaning the default: threads, the shortest prompt)."""
    value = _integer(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


def _integer(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an integer, got {text!r}") from None


BACKENDS = ("torch", "mindspore")


def backend_list(text: str) -> str:
    """An argparse type: a comma-separated list of native backends."""
    names = [name.strip() for name in text.split(",")]
    unknown = [name for name in names if name not in BACKENDS]
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"must be a comma-separated list of {', '.join(BACKENDS)}, got {text!r}")
    return ",".join(names)


def kernels_spec(text: str) -> str:
    """An argparse type: a ``load_model(kernels=...)`` spec ("auto", "plain" or a plan .json)."""
    try:
        return kernel_plan.check_spec(text)
    except (TypeError, ValueError) as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def positive_list(text: str) -> tuple:
    """An argparse type: a comma-separated list of integers >= 1 (concurrency levels)."""
    parts = [part.strip() for part in text.split(",") if part.strip()]
    if not parts or not all(part.isdigit() and int(part) >= 1 for part in parts):
        raise argparse.ArgumentTypeError(f"must be a comma-separated list of integers >= 1, got {text!r}")
    return tuple(int(part) for part in parts)


class HelpFormatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """Descriptions as written (the module docstrings, their reST ````literals```` shown plain on a
    terminal), every flag's help followed by its default, unless the help already says what the
    default means."""

    def _fill_text(self, text, width, indent):
        return super()._fill_text(_LITERAL.sub(r"\1", text), width, indent)

    def _get_help_string(self, action):
        text = action.help or ""
        if "(default" in text or "%(default)" in text or action.default is argparse.SUPPRESS:
            return text
        return super()._get_help_string(action)


class OneLineParser(argparse.ArgumentParser):
    """An argument parser whose usage errors are one line (``prog: error: ...``, exit 2), as the
    rest of the CLI's (its subcommands' parsers are of the same class)."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message}\n")


def add_command(sub, name: str, summary: str):
    """A bench subcommand's parser: ``summary`` is its line in ``hyper-gen bench --help``; every flag
    it gets shows its help and default (``HelpFormatter``); ``-v`` shows the frameworks' logs."""
    parser = sub.add_parser(name, help=summary, description=summary + ".", formatter_class=HelpFormatter)
    parser.add_argument("-v", "--verbose", action="store_true", help="show the frameworks' own log messages")
    return parser
