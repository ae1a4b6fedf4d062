"""The README tells the truth: one page, its two commands exist and are CI's, it links every
docs page, and each row of its figures links a section that holds them (links and what they
name: tests/test_docs.py)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

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


FIGURE = re.compile(r"(?<![\w.])(\d+(?:,\d{3})*(?:\.\d+)?)(?![\d])")
"""A number as a table writes it: 5.8, 0.165, 1,024, 6 (of 6/10)."""


def section_text(page: Path, anchor: str) -> str:
    """The text under the heading of ``page`` whose anchor is ``anchor``, up to the next heading
    of the same or a higher level."""
    lines = page.read_text().splitlines()
    fenced, in_code = set(), False
    for i, line in enumerate(lines):
        in_code ^= line.startswith("```")
        if in_code or line.startswith("```"):
            fenced.add(i)
    for i, line in enumerate(lines):
        match = None if i in fenced else re.fullmatch(r"(#{1,6}) (.+)", line)
        if match and heading_anchors_of_line(match.group(2)) == anchor:
            level = len(match.group(1))
            end = next((j for j in range(i + 1, len(lines)) if j not in fenced
                        and re.match(rf"#{{1,{level}}} ", lines[j])), len(lines))
            return "\n".join(lines[i:end])
    raise AssertionError(f"{page.name} has no section #{anchor}")


def heading_anchors_of_line(heading: str) -> str:
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def figures(cell: str) -> list[str]:
    """The figures of a table cell (link targets and counts of runs left out)."""
    cell = re.sub(r"\]\([^)]*\)|\b\d+ runs\b", "]", cell)
    return FIGURE.findall(cell)


def figures_missing(row: str, section: str) -> list[str]:
    """The figures of a README table row's baseline and elasticft cells that its linked
    section does not hold (pure). A figure is held when the section writes it, or writes it
    with more decimals (574 for 574.1)."""
    cells = [c.strip() for c in row.strip().strip("|").split("|")]
    missing = []
    for figure in (f for cell in cells[1:3] for f in figures(cell)):
        number = re.escape(figure.replace(",", "")) + r"(?:\.\d+)?" if "." not in figure \
            else re.escape(figure)
        if not re.search(rf"(?<![\w.]){number}(?![\d])", section.replace(",", "")):
            missing.append(figure)
    return missing


def readme_table_rows() -> list[tuple[str, str]]:
    """(row, link) of each row of the README's tables whose last cell links a page of docs/."""
    rows = []
    for line in README.read_text().splitlines():
        link = re.search(r"\]\((docs/[\w.-]+\.md(?:#[\w-]+)?)\)\s*\|\s*$", line)
        if line.startswith("|") and link:
            rows.append((line, link.group(1)))
    return rows


@pytest.mark.parametrize(("row", "section", "missing"), [
    ("| kill | 5.8 s | 0.6 s | [x](docs/b.md#a) |", "torchrun 5.8 s, elasticft 0.6 s", []),
    ("| kill | 5.4 s | 0.74 s | [x](docs/b.md#a) |", "elasticft 0.737 s", ["5.4", "0.74"]),
    ("| stall | 574-744 ms | 4.3 ms | [x](docs/b.md#a) |", "574.1 ms 744.1 ms 4.3 ms", []),
    ("| 64 agents | 8.07 s | 1.87 s | [x](docs/b.md#a) |", "1.63 s | 8.07 s", ["1.87"]),
    ("| cycles | 6/10 | 10/10 | [x](docs/b.md#a) |", "ok 6/10 ... ok 10/10", []),
])
def test_the_row_check_finds_a_figure_its_section_lacks(row: str, section: str,
                                                        missing: list[str]) -> None:
    assert figures_missing(row, section) == missing


def test_each_readme_table_row_links_a_section_that_holds_its_figures() -> None:
    rows = readme_table_rows()
    assert len(rows) >= 10, rows
    lacking = []
    for row, link in rows:
        path, _, anchor = link.partition("#")
        if not anchor:
            lacking.append(f"{link}: links a page, not the section of its run")
            continue
        missing = figures_missing(row, section_text(ROOT / path, anchor))
        if missing:
            lacking.append(f"{link}: {missing} in {row[:60]}")
    assert not lacking, f"README rows whose linked section lacks their figures: {lacking}"
