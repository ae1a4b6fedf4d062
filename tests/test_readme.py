"""The README tells the truth: one page, its two commands exist and are CI's, it links every
docs page (links and what they name: tests/test_docs.py)."""

from __future__ import annotations

from pathlib import Path

from tests.conftest import ROOT
from tests.test_docs import relative_links

README = ROOT / "README.md"
DOCS = ROOT / "docs"
MAX_README_LINES = 120


def test_readme_commands_exist_and_are_what_ci_runs() -> None:
    readme = README.read_text()
    for command in ("bash scripts/demo.sh", "bash scripts/test.sh"):
        assert command in readme
        assert (ROOT / command.split()[1]).is_file()
    assert "bash scripts/test.sh" in (ROOT / ".ci" / "run").read_text()


def test_readme_fits_on_a_page() -> None:
    lines = len(README.read_text().splitlines())
    assert lines <= MAX_README_LINES, (
        f"README.md has {lines} lines (at most {MAX_README_LINES}): move detail into docs/"
    )


def test_readme_links_every_docs_page() -> None:
    linked = {Path(t).name for t in relative_links(README) if t.startswith("docs/")}
    unlinked = sorted(p.name for p in DOCS.glob("*.md") if p.name not in linked)
    assert not unlinked, f"docs pages the README does not link: {unlinked}"
