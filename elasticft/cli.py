"""``elasticft``: the tools around a run (report, status, checkpoints, blacklist, plan...).

Each subsystem contributes its subcommands through a ``register(subparsers)`` function listed in
:data:`SUBCOMMAND_MODULES`; a subcommand's handler takes the parsed namespace and returns the exit
code. User mistakes are one line on stderr and exit code 2.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys
from collections.abc import Sequence

# Modules exposing ``register(subparsers: argparse._SubParsersAction) -> None``.
SUBCOMMAND_MODULES: tuple[str, ...] = (
    "elasticft.chaos",
    "elasticft.ckpt.commands",
    "elasticft.plan.cli",
    "elasticft.rendezvous.cli",
    "elasticft.report.cli",
)


class CliError(Exception):
    """A user mistake: printed as one line, exit code 2."""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="elasticft", description=__doc__.splitlines()[0])
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name in SUBCOMMAND_MODULES:
        importlib.import_module(name).register(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.handler(args) or 0)
    except CliError as e:
        print(f"elasticft {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
