"""HyperParallel, a test dependency that is not on the package index: how to install it, and what a
test that needs it does without it.

README.md's second command installs it from ``$HYPERPARALLEL_SRC`` (a path or a git URL; by default
the public repository at the tested commit, and ``.ci/run`` points it at the vendored tarball beside
the checkout where that exists). Someone who ran only ``pip install -e ".[torch,mindspore,test]"``
gets its tests skipped with the sentence that says how to install it; CI (``CI=true``, as
``.ci/run`` exports) gets them failed, so a broken install step cannot pass as a skip.
"""

import importlib.util
import os

import pytest

DEFAULT_SRC = "git+https://github.com/mindspore-ai/hyper-parallel.git@fdd0a808423ac220f66a5009fdd827429b6fb82f"
MISSING = (
    "HyperParallel is not installed (it is not on the package index): "
    f'pip install --no-deps "${{HYPERPARALLEL_SRC:-{DEFAULT_SRC}}}"'
)


def in_ci(environ=None) -> bool:
    """``CI=true`` (or 1 / yes), as CI services and ``.ci/run`` set it."""
    return (os.environ if environ is None else environ).get("CI", "").strip().lower() in ("true", "1", "yes")


def require_hyperparallel(installed=None, environ=None) -> None:
    """Return when ``hyper_parallel`` can be imported; else skip the calling test with ``MISSING``,
    or fail it under CI. ``installed`` / ``environ``: stand-ins for the real checks (tests of this)."""
    if installed is None:
        installed = importlib.util.find_spec("hyper_parallel") is not None
    if installed:
        return
    if in_ci(environ):
        pytest.fail(f"{MISSING} (CI=true: its tests fail instead of skipping)", pytrace=False)
    pytest.skip(MISSING)
