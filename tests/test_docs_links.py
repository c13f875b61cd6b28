"""The files and sections the README, CONTRIBUTING.md, docs/ and the demo model's card point to exist
(docs/performance.md once cited five files a refactor had removed). A path written as history
("then `tests/test_blocked_gemm.py`") is exempt."""

import glob
import os
import re

import pytest
from launch import REPO

DOCS = ["README.md", "CONTRIBUTING.md", "hyper_gen/demo/model/README.md"] + sorted(
    os.path.relpath(p, REPO) for p in glob.glob(os.path.join(REPO, "docs", "*.md"))
)
PATH = re.compile(r"(?<![\w/.])((?:hyper_gen|tests|examples|docs)/[\w./-]*\w\.(?:py|md|json|jinja))\b")
LINK = re.compile(r"\]\(((?:docs/)?[\w.-]+\.md)(?:#([\w-]+))?\)")


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces as hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _read(name):
    with open(os.path.join(REPO, name), encoding="utf-8") as f:
        return f.read()


@pytest.mark.parametrize("name", DOCS)
def test_every_cited_file_exists(name):
    text = _read(name)
    missing = []
    for match in PATH.finditer(text):
        before = text[max(0, match.start() - 8) : match.start()]
        if re.search(r"(then|old) `?$", before):  # history
            continue
        if not os.path.exists(os.path.join(REPO, match.group(1))):
            missing.append(match.group(1))
    assert not missing, f"{name} cites files that do not exist: {sorted(set(missing))}"


@pytest.mark.parametrize("name", DOCS)
def test_every_markdown_link_and_anchor_resolves(name):
    folder = os.path.dirname(name)
    for target, anchor in LINK.findall(_read(name)):
        path = os.path.normpath(os.path.join(folder, target)) if not target.startswith("docs/") else target
        assert os.path.exists(os.path.join(REPO, path)), (name, target)
        if anchor:
            headings = re.findall(r"^#+ (.+)$", _read(path), re.M)
            assert anchor in {_slug(h) for h in headings}, (name, target, anchor)
