"""The frameworks' own log output, quiet by default in every product part (CLI, server, benchmarks)."""

from __future__ import annotations

import os


def quiet_framework_logs() -> None:
    """Errors only from the frameworks' C++ logs (MindSpore's glog: ``GLOG_v``), unless ``-v``.

    Set before a backend is imported, which is when MindSpore reads it (its "Backend Ascend is not
    available" warnings come from that import); a value the user exported wins. transformers' own
    warnings go the same way."""
    os.environ.setdefault("GLOG_v", "3")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
