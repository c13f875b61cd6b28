"""One program under either launcher: ``launcher_backend()`` is the framework of the launcher that
started the process, and a model of the other framework is refused naming that launcher (it used to
say "a single process with no process group" under msrun, where the job had two)."""

import pytest
from demo_task import DEMO_MODEL_DIR

from hyper_gen import load_model
from hyper_gen.parallel.launcher import launched_by, launcher_backend

MSRUN = {"MS_ROLE": "MS_WORKER", "MS_WORKER_NUM": "2", "MS_NODE_ID": "0"}
TORCHRUN = {"TORCHELASTIC_RUN_ID": "none"}


@pytest.fixture
def launched(monkeypatch):
    def launch(variables):
        for name in ("MS_ROLE", "MS_WORKER_NUM", "MS_NODE_ID", "TORCHELASTIC_RUN_ID"):
            monkeypatch.delenv(name, raising=False)
        for name, value in variables.items():
            monkeypatch.setenv(name, value)

    return launch


@pytest.mark.parametrize(
    "variables, launcher, backend",
    [(MSRUN, "msrun", "mindspore"), (TORCHRUN, "torchrun", "torch"), ({}, None, "torch")],
)
def test_the_launchers_framework(variables, launcher, backend, launched):
    launched(variables)
    assert launched_by() == launcher
    assert launcher_backend() == backend
    assert launcher_backend(default="mindspore") == (backend if launcher else "mindspore")


@pytest.mark.parametrize(
    "variables, backend, launcher, wanted",
    [(MSRUN, "torch", "msrun", "mindspore"), (TORCHRUN, "mindspore", "torchrun", "torch")],
    ids=["torch-under-msrun", "mindspore-under-torchrun"],
)
@pytest.mark.parametrize("parallel", [{"tp": 2}, {"cp": 2}], ids=["tp", "cp"])
def test_the_other_frameworks_launcher_is_named(variables, backend, launcher, wanted, parallel, launched):
    launched(variables)
    with pytest.raises(ValueError, match=f"started by {launcher}") as info:
        load_model(DEMO_MODEL_DIR, backend=backend, **parallel)
    assert f"backend={wanted!r}" in str(info.value) and "launcher_backend()" in str(info.value)


def test_one_process_without_a_launcher_keeps_its_message(launched):
    launched({})
    with pytest.raises(ValueError, match="single process with no process group"):
        load_model(DEMO_MODEL_DIR, backend="torch", tp=2)
