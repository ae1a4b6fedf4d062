"""Fault injection for a running job: ``elasticft chaos ...``.

Faults are real: signals sent to the real worker processes, found through the run's event log
(the newest ``workers_started`` event names every rank's pid). Users run these against their own
job to see what recovery costs them; the demo and the tests use the same commands.
"""

from __future__ import annotations

import argparse
import os
import signal
import time
from pathlib import Path

from elasticft.events import read_events


class ChaosError(Exception):
    pass


def current_worker_pids(run_dir: Path) -> dict[int, int]:
    """Global rank -> pid of the newest attempt's workers in ``run_dir``."""
    started = [e for e in read_events(run_dir) if e["kind"] == "workers_started"]
    if not started:
        raise ChaosError(f"no workers_started event under {run_dir}; is the job running there?")
    pids: dict[int, int] = {}
    newest_by_node: dict[str, dict] = {}
    for event in started:
        newest_by_node[event["node"]] = event
    for event in newest_by_node.values():
        pids.update({int(rank): int(pid) for rank, pid in event["pids"].items()})
    return pids


def wait_for(path: Path | None, timeout_s: float) -> None:
    if path is None:
        return
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        if time.monotonic() > deadline:
            raise ChaosError(f"{path} did not appear within {timeout_s:g} s")
        time.sleep(0.05)


def signal_rank(run_dir: Path, rank: int, sig: signal.Signals) -> int:
    """Sends ``sig`` to the current worker of ``rank``; returns its pid."""
    pids = current_worker_pids(run_dir)
    if rank not in pids:
        raise ChaosError(f"rank {rank} is not running; ranks are {sorted(pids)}")
    os.kill(pids[rank], sig)
    return pids[rank]


def _cmd_signal(args: argparse.Namespace) -> int:
    from elasticft.cli import CliError

    try:
        sig = signal.Signals[f"SIG{args.signal.upper().removeprefix('SIG')}"]
    except KeyError:
        raise CliError(f"unknown signal {args.signal!r}; use e.g. KILL, TERM, STOP") from None
    try:
        wait_for(args.when_exists, args.timeout)
        if args.after:
            time.sleep(args.after)
        pid = signal_rank(args.run_dir, args.rank, sig)
    except (ChaosError, ProcessLookupError) as e:
        raise CliError(str(e)) from None
    print(f"sent {sig.name} to rank {args.rank} (pid {pid})")
    return 0


def register(subparsers: argparse._SubParsersAction) -> None:
    chaos = subparsers.add_parser("chaos", help="inject faults into a running job")
    kinds = chaos.add_subparsers(dest="fault", required=True, metavar="FAULT")
    for name, default_signal, text in (
        ("kill", "KILL", "SIGKILL one worker (a crash)"),
        ("term", "TERM", "SIGTERM one worker (killed by mistake)"),
        ("stop", "STOP", "SIGSTOP one worker (a hang)"),
    ):
        p = kinds.add_parser(name, help=text)
        p.add_argument("--run-dir", type=Path, required=True, help="the run's event directory")
        p.add_argument("--rank", type=int, default=0, help="global rank to hit")
        p.add_argument("--after", type=float, default=0.0, help="seconds to wait first")
        p.add_argument("--when-exists", type=Path, help="wait until this file exists first")
        p.add_argument("--timeout", type=float, default=300.0, help="for --when-exists")
        p.set_defaults(handler=_cmd_signal, signal=default_signal)
