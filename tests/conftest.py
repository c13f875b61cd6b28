import os
import sys

sys.path.insert(0, os.path.dirname(__file__))

# kernel plans timed by the suite (kernels="auto") live in one folder per run, shared with the
# torchrun / msrun / CLI subprocesses the tests start, never in the user's cache
if "HYPER_GEN_CACHE_DIR" not in os.environ:
    import tempfile

    os.environ["HYPER_GEN_CACHE_DIR"] = tempfile.mkdtemp(prefix="hyper_gen-test-cache-")

import pytest
from backend_harness import HARNESSES

# the conformance suite runs on every backend listed here
BACKENDS = ["torch", "mindspore"]


@pytest.fixture(params=BACKENDS)
def backend(request):
    return HARNESSES[request.param]()


@pytest.fixture(scope="module")
def one_torch_thread():
    """Tiny matmuls on a shared 2-core machine: a second OpenMP thread costs 30x in waits."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def cli(capfd, monkeypatch):
    """``cli(args, stdin=None, env=None)``: the ``hyper-gen`` CLI run in this process (tests/cli_runner.py)."""
    from cli_runner import InProcessCLI

    return InProcessCLI(capfd, monkeypatch)
