"""The frameworks' own log output, quiet by default in every product part (CLI, server, benchmarks)."""

from __future__ import annotations

import os
import sys
import warnings


def quiet_framework_logs() -> None:
    """Errors only from the frameworks' C++ logs (MindSpore's glog: ``GLOG_v``), unless ``-v``.

    Set before a backend is imported, which is when MindSpore reads it (its "Backend Ascend is not
    available" warnings come from that import); a value the user exported wins. transformers' own
    warnings go the same way, and so do its progress bars and other libraries' FutureWarnings."""
    os.environ.setdefault("GLOG_v", "3")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    # transformers' "Loading weights" bars (read when huggingface_hub is imported; the bars of an
    # import that already happened are switched off too): under a launcher each rank draws its own,
    # interleaved with rank 0's chat prompt
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    hf_logging = sys.modules.get("transformers.utils.logging")  # (imported already, or it reads the variable)
    if os.environ["HF_HUB_DISABLE_PROGRESS_BARS"] == "1" and hf_logging is not None:
        hf_logging.disable_progress_bar()
    # a library's deprecation notice about another library (HyperParallel calling torch's
    # all_gather_into_tensor, once per rank in the middle of a chat line) is nothing a CLI user can act on
    warnings.filterwarnings("ignore", category=FutureWarning)
