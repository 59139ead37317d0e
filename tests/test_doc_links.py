"""Every relative link in README.md and docs/ resolves to a file (or folder) of the repository, and every
anchor a link names (`page.md#heading`) is a heading of that page."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
LINK = re.compile(r"\]\(([^)\s]+)\)")  # [text](target): markdown links and images
EXTERNAL = ("http://", "https://", "mailto:")


def links(page: Path) -> list[str]:
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)  # code blocks hold no links
    return [t for t in LINK.findall(text) if not t.startswith(EXTERNAL)]


def anchors(page: Path) -> set[str]:
    """GitHub's anchors of a page's headings: lower case, punctuation dropped, spaces as dashes."""
    out = set()
    for heading in re.findall(r"^#+ (.+)$", page.read_text(), flags=re.M):
        slug = re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")
        out.add(slug)
    return out


CASES = [(page, target) for page in PAGES for target in links(page)]


@pytest.mark.parametrize("page, target", CASES, ids=[f"{p.relative_to(ROOT)}->{t}" for p, t in CASES])
def test_relative_link_resolves(page, target):
    path, _, anchor = target.partition("#")
    resolved = page if not path else (page.parent / path).resolve()
    assert resolved.exists(), f"{page.relative_to(ROOT)}: {target} does not exist"
    if anchor and resolved.suffix == ".md":
        assert anchor in anchors(resolved), f"{page.relative_to(ROOT)}: no heading #{anchor} in {path or page.name}"


def test_links_are_found():
    assert len(CASES) > 20
