"""The backends' HYPER_GEN_* speed switches (hyper_gen.switches): a value they cannot mean is a
ValueError naming the variable and the value, at load_model on both backends, before any work (at
the CLI one line, exit 2), never a traceback mid-generation or a typo silently ignored."""

import os

import pytest

from hyper_gen import switches

CLI = ["generate", "--prompt", "rev 12345 =", "--max-new-tokens", "6"]


@pytest.mark.parametrize("value, expected", [(None, True), ("1", True), ("0", False)])
def test_a_flag_is_0_or_1(monkeypatch, value, expected):
    if value is None:
        monkeypatch.delenv("HYPER_GEN_TEST_FLAG", raising=False)
    else:
        monkeypatch.setenv("HYPER_GEN_TEST_FLAG", value)
    assert switches.flag("HYPER_GEN_TEST_FLAG") is expected


@pytest.mark.parametrize("value", ["yes", "off", "", " 1", "2"])
def test_any_other_flag_value_is_named(monkeypatch, value):
    monkeypatch.setenv("HYPER_GEN_TEST_FLAG", value)
    with pytest.raises(ValueError, match=f"HYPER_GEN_TEST_FLAG must be 0 or 1, got {value!r}"):
        switches.flag("HYPER_GEN_TEST_FLAG")


def test_megabytes_are_bytes(monkeypatch):
    monkeypatch.delenv("HYPER_GEN_TEST_MB", raising=False)
    assert switches.megabytes("HYPER_GEN_TEST_MB", 2048) == 2048 << 20
    monkeypatch.setenv("HYPER_GEN_TEST_MB", "0.5")
    assert switches.megabytes("HYPER_GEN_TEST_MB", 2048) == 1 << 19
    monkeypatch.setenv("HYPER_GEN_TEST_MB", "0")
    assert switches.megabytes("HYPER_GEN_TEST_MB", 2048) == 0


@pytest.mark.parametrize("value", ["lots", "-1", "nan", "inf", ""])
def test_a_bad_budget_is_named(monkeypatch, value):
    monkeypatch.setenv("HYPER_GEN_TEST_MB", value)
    with pytest.raises(ValueError, match=f"HYPER_GEN_TEST_MB must be a number of MB >= 0, got {value!r}"):
        switches.megabytes("HYPER_GEN_TEST_MB", 2048)


@pytest.mark.parametrize(
    "backend, name, value",
    [
        ("torch", "HYPER_GEN_TORCH_ONEDNN_GEMM_MB", "x"),  # was a traceback from inside the first forward
        ("torch", "HYPER_GEN_TORCH_ONEDNN_GEMM_MB", "-5"),
        ("torch", "HYPER_GEN_KERNELS", "fast"),
        ("torch", "HYPER_GEN_PAGED_KERNEL", "no"),
        ("mindspore", "HYPER_GEN_MINDSPORE_JIT", "off"),  # was read as "on"
        ("mindspore", "HYPER_GEN_KERNELS", "fast"),
    ],
)
def test_a_bad_switch_is_one_line_at_the_cli_before_any_work(backend, name, value, cli):
    """The CLI run in this process (tests/cli_runner.py): the switches are read at load_model, not at
    import, so a fresh process (10-30 s of framework imports a case) checks nothing more."""
    result = cli(CLI + ["--backend", backend], env=dict(os.environ, **{name: value}))
    assert result.returncode == 2, result.stderr[-2000:]
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert f"{name} must be " in lines[0] and repr(value) in lines[0], lines[0]
    assert "rev 12345" not in result.stdout  # nothing generated
