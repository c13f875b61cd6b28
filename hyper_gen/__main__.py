"""``python -m hyper_gen ...`` (and ``msrun ... hyper_gen/__main__.py ...``) runs the CLI."""

import os
import sys

if __package__ in (None, ""):  # run as a file path, as msrun does
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    sys.path = [p for p in sys.path if os.path.abspath(p) != os.path.dirname(os.path.abspath(__file__))]

from hyper_gen.cli import entry_point  # noqa: E402

if __name__ == "__main__":
    entry_point()
