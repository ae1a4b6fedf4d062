"""The README tells the truth: one page, its two commands exist and are CI's, its links resolve."""

from __future__ import annotations

import re
from pathlib import Path

from tests.conftest import ROOT

README = ROOT / "README.md"
DOCS = ROOT / "docs"
MAX_README_LINES = 300
# Pages written on other branches and linked before they land; a link to any other missing
# file is an error.
LINK = re.compile(r"\]\(([^)\s]+)\)")


def relative_links(page: Path) -> list[str]:
    targets = (m.group(1).split("#")[0] for m in LINK.finditer(page.read_text()))
    return [t for t in targets if t and "://" not in t and not t.startswith("mailto:")]


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


def test_every_relative_link_resolves() -> None:
    broken = []
    for page in [README, *sorted(DOCS.glob("*.md"))]:
        for target in relative_links(page):
            path = (page.parent / target).resolve()
            if not path.exists():
                broken.append(f"{page.relative_to(ROOT)} -> {target}")
    assert not broken, f"links to missing files: {broken}"


def test_readme_links_every_docs_page() -> None:
    linked = {Path(t).name for t in relative_links(README) if t.startswith("docs/")}
    unlinked = sorted(p.name for p in DOCS.glob("*.md") if p.name not in linked)
    assert not unlinked, f"docs pages the README does not link: {unlinked}"
