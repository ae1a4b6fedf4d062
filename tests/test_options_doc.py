"""docs/options.md is the page scripts/options_table.py generates from the current config."""

from __future__ import annotations

import importlib.util

from tests.conftest import ROOT


def test_options_page_is_current() -> None:
    script = ROOT / "scripts" / "options_table.py"
    spec = importlib.util.spec_from_file_location("options_table", script)
    assert spec is not None and spec.loader is not None
    options_table = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(options_table)
    current = (ROOT / "docs" / "options.md").read_text()
    assert current == options_table.page(), (
        f"docs/options.md is stale: run `{options_table.REGENERATE}` and commit the result"
    )
