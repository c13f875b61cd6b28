import os
import sys

sys.path.insert(0, os.path.dirname(__file__))

import pytest
from backend_harness import HARNESSES

# the conformance suite runs on every backend listed here
BACKENDS = ["torch", "mindspore"]


@pytest.fixture(params=BACKENDS)
def backend(request):
    return HARNESSES[request.param]()
