"""The README tells the truth: one page, its two commands exist and are CI's, its links resolve."""

from __future__ import annotations

import re
from pathlib import Path

from tests.conftest import ROOT

README = ROOT / "README.md"
DOCS = ROOT / "docs"
MAX_README_LINES = 120
LINK = re.compile(r"\]\(([^)\s]+)\)")
HEADING = re.compile(r"#{1,6} (.+)")


def relative_links(page: Path, *, anchors: bool = False) -> list[str]:
    """The page's links to files of this repository (with their ``#anchor`` if asked)."""
    targets = (m.group(1) if anchors else m.group(1).split("#")[0]
               for m in LINK.finditer(page.read_text()))
    return [t for t in targets if t and "://" not in t and not t.startswith("mailto:")]


def heading_anchors(page: Path) -> set[str]:
    """The anchors GitHub gives a page's headings: lower case, punctuation dropped, spaces
    made hyphens, a repeated heading numbered."""
    anchors: set[str] = set()
    seen: dict[str, int] = {}
    in_code = False
    for line in page.read_text().splitlines():
        if line.startswith("```"):
            in_code = not in_code
        match = None if in_code else HEADING.fullmatch(line)
        if match is None:
            continue
        slug = re.sub(r"[^\w\- ]", "", match.group(1).strip().lower()).replace(" ", "-")
        count = seen.get(slug, 0)
        seen[slug] = count + 1
        anchors.add(slug if count == 0 else f"{slug}-{count}")
    return anchors


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


def test_every_link_to_a_section_names_a_heading_of_its_page() -> None:
    broken = []
    for page in [README, *sorted(DOCS.glob("*.md"))]:
        for link in relative_links(page, anchors=True):
            target, _, anchor = link.partition("#")
            path = (page.parent / target).resolve() if target else page
            if anchor and path.suffix == ".md" and path.exists() \
                    and anchor not in heading_anchors(path):
                broken.append(f"{page.relative_to(ROOT)} -> {link}")
    assert not broken, f"links to sections that no heading has: {broken}"


def test_readme_links_every_docs_page() -> None:
    linked = {Path(t).name for t in relative_links(README) if t.startswith("docs/")}
    unlinked = sorted(p.name for p in DOCS.glob("*.md") if p.name not in linked)
    assert not unlinked, f"docs pages the README does not link: {unlinked}"
