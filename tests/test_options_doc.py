"""docs/options.md is current, --help stays short, and every documented command line parses."""

from __future__ import annotations

import importlib.util
import re
import shlex

from elasticft.config import ConfigError
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


MAX_ELASTICFT_OPTIONS = 43
"""Issue #31: every option a user would set for a reason the docs give, and no more (the 43rd:
the way out of torch's experimental reconfigure, ``--recovery-inprocess-regroup new-group``)."""


def test_help_lists_at_most_43_elasticft_options() -> None:
    from elasticft.run import build_parser

    help_text = build_parser().format_help()
    own = help_text.split("\nelasticft options:\n", 1)[1]
    # An option's line is "  --flag METAVAR  help"; a wrapped description may also start "--".
    flags = sorted(set(re.findall(r"^  (--[a-z][a-z0-9-]*) \[?[A-Z]", own, flags=re.M)))
    assert "--config" in flags and "--layout" in flags
    assert len(flags) <= MAX_ELASTICFT_OPTIONS, (
        f"elasticft-run --help lists {len(flags)} elasticft options (at most "
        f"{MAX_ELASTICFT_OPTIONS}): make a knob few users turn a config.tuning() constant"
    )


RUN_LINE = re.compile(
    r"^(?:\$\s+)?(?:exec\s+)?(?:[A-Z_][A-Z0-9_]*=\S*\s+)*(elasticft-run(?:\s.*)?)$")
FENCE = re.compile(r"^```[^\n]*\n(.*?)^```", flags=re.S | re.M)


def documented_run_commands() -> list[tuple[str, str]]:
    """Every ``elasticft-run`` command line in a fenced block of README.md and docs/*.md, with
    its continuation lines joined: (page, command)."""
    commands = []
    for page in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for block in FENCE.findall(page.read_text()):
            for line in re.sub(r"\\\n\s*", " ", block).splitlines():
                match = RUN_LINE.match(line.strip())
                # A table or log line that merely names the launcher has no option after it.
                if match and [*match.group(1).split(), ""][1].startswith("-"):
                    commands.append((page.name, match.group(1)))
    return commands


def test_every_documented_command_line_parses() -> None:
    from elasticft import command_line, options
    from elasticft.run import UsageError, build_parser

    commands = documented_run_commands()
    assert len(commands) >= 4, commands  # the README's quick starts, the etcd and Slurm pages
    for page, command in commands:
        argv = shlex.split(command, comments=True)[1:]
        try:
            args = command_line.parse_args(build_parser(), argv)
            options.from_namespace(args, {})
        except (UsageError, ConfigError) as e:
            raise AssertionError(f"{page}: `{command}` does not parse: {e}") from None
        assert args.training_script, f"{page}: `{command}` names no training script"
