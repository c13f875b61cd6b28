"""The extras install beside what users already have: tested ranges, not single versions that clash
(``transformers==5.23.0`` made pip's ResolutionImpossible beside 5.24); every test tool has an upper
bound (an open ``pytest>=8`` let pip pick 9.2, on which the CLI tests' harness then broke), and the
server's extra brings the client its examples use."""

import os

import pytest
from launch import REPO
from packaging.requirements import Requirement

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10: pytest's own dependency
    import tomli as tomllib

with open(os.path.join(REPO, "pyproject.toml"), "rb") as f:
    EXTRAS = tomllib.load(f)["project"]["optional-dependencies"]


def _requirement(extra, name):
    found = [Requirement(r) for r in EXTRAS[extra] if Requirement(r).name.lower() == name]
    assert len(found) == 1, (extra, name, EXTRAS[extra])
    return found[0]


@pytest.mark.parametrize("extra", ["hf", "serve", "test"])
def test_transformers_is_a_range_that_takes_the_tested_releases(extra):
    spec = _requirement(extra, "transformers").specifier
    assert spec.contains("5.23.0") and spec.contains("5.24.0") and not spec.contains("6.0.0"), spec


def test_pytest_takes_the_releases_the_suite_passed_on():
    spec = _requirement("test", "pytest").specifier
    assert spec.contains("9.0.3") and spec.contains("9.2.0") and not spec.contains("10.0"), spec


@pytest.mark.parametrize("extra", sorted(EXTRAS))
def test_every_requirement_has_an_upper_bound(extra):
    for line in EXTRAS[extra]:
        operators = {s.operator for s in Requirement(line).specifier}
        assert operators & {"==", "<", "<=", "~="}, f"[{extra}] {line} has no upper bound"


def test_serve_installs_the_openai_client():
    assert _requirement("serve", "openai").specifier.contains("3.57.0")
