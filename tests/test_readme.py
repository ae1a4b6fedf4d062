"""The README tells the truth: its two commands exist and its option table matches the code."""

from __future__ import annotations

import subprocess
import sys

from tests.conftest import ROOT


def test_readme_commands_exist() -> None:
    readme = (ROOT / "README.md").read_text()
    for command in ("bash scripts/demo.sh", "bash scripts/test.sh"):
        assert command in readme
        assert (ROOT / command.split()[1]).is_file()
    assert "bash scripts/test.sh" in (ROOT / ".ci" / "run").read_text()


def test_readme_option_table_is_current() -> None:
    table = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "options_table.py")],
        capture_output=True, text=True, check=True,
    ).stdout.strip()
    assert table in (ROOT / "README.md").read_text(), (
        "README's option table is stale: paste `python scripts/options_table.py` into it"
    )
