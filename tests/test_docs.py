"""The user docs: the README stays a user's page, and every relative link in it and in docs/ resolves."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
README_MAX_LINES = 180


def relative_links(page: Path) -> list[str]:
    return [link for link in re.findall(r"\]\(([^)#\s]+)", page.read_text()) if not re.match(r"[a-z]+://", link)]


def test_readme_is_short():
    lines = len((REPO / "README.md").read_text().splitlines())
    assert lines <= README_MAX_LINES, f"README.md has {lines} lines: move depth to docs/"


@pytest.mark.parametrize("page", PAGES, ids=[p.name for p in PAGES])
def test_links_resolve(page):
    broken = [link for link in relative_links(page) if not (page.parent / link).exists()]
    assert not broken, f"{page.name}: broken links {broken}"


def test_link_check_sees_a_broken_link(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("[ok](page.md) [gone](missing.md) [web](https://example.org/x)")
    assert [link for link in relative_links(page) if not (page.parent / link).exists()] == ["missing.md"]
