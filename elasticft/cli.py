"""``elasticft``: the tools around a run (report, status, checkpoints, blacklist, plan...).

Each subsystem contributes its subcommands through a ``register(subparsers)`` function in the
module named for it in :data:`SUBCOMMANDS`. Only the chosen command's module is imported, so a
command that does not need torch starts in a fraction of a second. A handler takes the parsed
namespace and returns the exit code; user mistakes are one line on stderr and exit code 2.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys
from collections.abc import Sequence

# command -> (module exposing ``register(subparsers)``, one-line help for the command list).
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "report": ("elasticft.report.cli", "TOR, ETTR, MTBF and a per-fault breakdown of a run"),
    "status": ("elasticft.report.status", "a job's round, leader, participants and standbys"),
    "blacklist": ("elasticft.rendezvous.cli", "list, add or remove refused nodes (etcd-v3)"),
    "ckpt": ("elasticft.ckpt.commands", "list, verify and export durable checkpoints"),
    "plan": ("elasticft.plan.cli", "rank 3D-parallel layouts for a cluster and a model"),
    "chaos": ("elasticft.chaos", "inject faults into a running job"),
}


class CliError(Exception):
    """A user mistake: printed as one line, exit code 2."""


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The full parser of ``command``'s module, or a light listing of every command."""
    parser = argparse.ArgumentParser(prog="elasticft", description=__doc__.splitlines()[0])
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    if command in SUBCOMMANDS:
        importlib.import_module(SUBCOMMANDS[command][0]).register(subparsers)
    else:
        for name, (_, text) in SUBCOMMANDS.items():
            subparsers.add_parser(name, help=text)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    from elasticft import logs, procs

    if argv is None:  # the console script
        procs.skip_final_collection()
    logs.configure(logging.WARNING)
    argv = list(sys.argv[1:] if argv is None else argv)
    command = next((a for a in argv if not a.startswith("-")), None)
    args = build_parser(command).parse_args(argv)
    from elasticft.extras import MissingExtra

    try:
        return int(args.handler(args) or 0)
    except (CliError, MissingExtra) as e:
        print(f"elasticft {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
