"""``elasticft status``: where a job stands now, from etcd and from its run's event log.

With ``--rdzv-id`` it shows the rendezvous membership (round, leader, participants, standbys and
the blacklist, read from etcd with the connection flags of ``elasticft-run``:
``--rdzv-endpoint``, ``--rdzv-conf``, or ``PET_RDZV_ENDPOINT`` / ``PET_RDZV_CONF`` /
``PET_RDZV_ID``). With ``--run-dir DIR`` it adds what the run's event log says now: each rank's
pid and host (the way to find a rank's process: a warm-started worker's ``/proc/<pid>/environ``
does not hold its ``RANK``), the newest diagnostics detections, each node's NCCL shim self-check,
the snapshots skipped and the silent data corruption the fingerprints found (alone, for a
``--standalone`` run without etcd, it shows only those). It lives with the report because, like
the report, it reads what every subsystem wrote; rendezvous keeps only its own commands.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path
from typing import Any

from elasticft.cli import CliError
from elasticft.diag.shimcheck import EVENT_KIND as NCCL_TIMINGS_KIND
from elasticft.events import read_events, sdc_line, snapshots_skipped_line
from elasticft.rendezvous.cli import add_connection_flags, connect, one_line
from elasticft.rendezvous.etcd import Keys, connection_error
from elasticft.rendezvous.membership import JobStatus, MemberRecord, read_status
from elasticft.report.tor import phase_name


def register(subparsers: argparse._SubParsersAction) -> None:
    status = subparsers.add_parser(
        "status",
        help="a job's round, leader, participants, standbys and the blacklist (etcd); with "
        "--run-dir, each rank's pid and host and the newest diagnostics detections",
    )
    status.add_argument(
        "--rdzv-id", default=os.environ.get("PET_RDZV_ID", ""), help="the job id (env PET_RDZV_ID)"
    )
    status.add_argument("--json", action="store_true", help="print JSON")
    status.add_argument(
        "--run-dir", type=Path, help="also show each rank's pid and host and the newest "
        "diagnostics detections of this run (its --run-dir); alone, without --rdzv-id, only those"
    )
    status.add_argument(
        "--detections", type=int, default=10, metavar="N", help="how many detections (default 10)"
    )
    add_connection_flags(status)
    status.set_defaults(handler=_status)


def _describe_member(member: MemberRecord) -> str:
    age = max(0.0, time.time() - member.updated_at)
    rank = f" rank {member.group_rank}" if member.state == "participant" else ""
    health = "" if member.health_ok else f" UNHEALTHY: {member.health_detail}"
    return f"{member.node_id}{rank} ({member.addr} pid {member.pid}, {age:.0f} s ago){health}"


def format_status(status: JobStatus) -> str:
    lines = [f"job {status.run_id}"]
    if status.round is None:
        lines.append("  round: none completed yet")
    else:
        r = status.round
        lines.append(
            f"  round {r.round}: {r.world_size} node(s) (min {r.min_nodes}, max {r.max_nodes}), "
            f"completed {time.strftime('%H:%M:%S', time.localtime(r.completed_at))}"
        )
    leader = status.leader
    lines.append(
        f"  leader: {leader.node_id} (round {leader.round})" if leader else "  leader: none alive"
    )
    for title, members in (
        ("participants", status.participants),
        ("standbys", status.standbys),
        ("joining", status.joining),
    ):
        lines.append(f"  {title}: {len(members)}")
        lines.extend(f"    {_describe_member(m)}" for m in members)
    lines.append(f"  blacklist: {len(status.blacklist)}")
    lines.extend(f"    {e.summary()}" for e in status.blacklist)
    return "\n".join(lines)


def recent_detections(run_dir: Path, limit: int) -> list[dict[str, Any]]:
    """The newest ``limit`` diagnostics detections in a run's event log, oldest first."""
    found = [e for e in read_events(run_dir) if e.get("kind") == "detection"]
    return found[-limit:] if limit > 0 else []


def format_detections(detections: list[dict[str, Any]], run_dir: Path) -> str:
    lines = [f"detections in {run_dir}: {len(detections) or 'none'}"]
    for event in detections:
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(event.get("time", 0.0)))
        lines.append(f"  {when}  {event.get('node', '?')}  {event.get('detector', '?')}: "
                     f"{event.get('message', '')}")
    return "\n".join(lines)


def worker_processes(run_dir: Path) -> list[dict[str, Any]]:
    """Each node's newest workers (its last ``workers_started`` event): node, host, attempt,
    rank → pid, and whether that node's agent has ended since. Warm-started workers carry their
    rank in the environment Python sees, not in ``/proc/<pid>/environ``: this is how a rank's
    process is found."""
    newest: dict[str, dict[str, Any]] = {}
    for event in read_events(run_dir):
        node = str(event.get("node", "?"))
        if event.get("kind") == "workers_started":
            newest[node] = {
                "node": node, "host": event.get("host", node), "attempt": event.get("attempt"),
                "pids": {int(rank): int(pid) for rank, pid in (event.get("pids") or {}).items()},
                "ended": False}
        elif event.get("kind") == "run_end" and node in newest:
            newest[node]["ended"] = True
    return sorted(newest.values(), key=lambda w: min(w["pids"], default=0))


def format_worker_processes(found: list[dict[str, Any]]) -> str:
    if not found:
        return "workers: none started yet"
    lines = ["workers (rank: pid on host):"]
    for workers in found:
        ended = ", ended" if workers["ended"] else ""
        lines.append(f"  node {workers['node']} (host {workers['host']}, attempt "
                     f"{workers['attempt']}{ended})")
        lines.extend(f"    rank {rank}: pid {pid} on {workers['host']}"
                     for rank, pid in sorted(workers["pids"].items()))
    return "\n".join(lines)


def recoveries(run_dir: Path) -> tuple[list[dict[str, Any]], int]:
    """The run's in-process recoveries (``recover_in_process`` events, oldest first) and its
    restarts of whole worker groups."""
    events = read_events(run_dir)
    return ([e for e in events if e.get("kind") == "recover_in_process"],
            sum(1 for e in events if e.get("kind") == "restart" and e.get("counted", True)))


def format_recoveries(found: list[dict[str, Any]], restarts: int) -> str:
    lines = [f"recoveries: {len(found)} in process, {restarts} restart(s)"]
    for event in found[-3:]:
        when = time.strftime("%H:%M:%S", time.localtime(event.get("time", 0.0)))
        phases = ", ".join(f"{phase_name(name)} {seconds:.2f} s"
                           for name, seconds in event.get("phases", {}).items())
        replaced = ",".join(sorted(event.get("replaced", {}))) or "none"
        by_spare = " (by the spare)" if event.get("spare") else ""
        lines.append(f"  {when}  {event.get('node', '?')}  generation "
                     f"{event.get('generation')}, replaced rank(s) {replaced}{by_spare}: {phases}")
    return "\n".join(lines)


def spares(run_dir: Path) -> dict[str, int]:
    """The run's pre-started spares (``--recovery-inprocess-spare``): started, ready, that took
    a rank, that exited while waiting."""
    events = read_events(run_dir)
    return {"started": sum(e.get("kind") == "spare_started" for e in events),
            "ready": sum(e.get("kind") == "spare_ready" for e in events),
            "took_rank": sum(bool(e.get("spare")) for e in events
                             if e.get("kind") == "recover_in_process"),
            "exited": sum(e.get("kind") == "spare_failed" for e in events)}


def format_spares(counts: dict[str, int]) -> str:
    return (f"spares: {counts['started']} started, {counts['ready']} ready, "
            f"{counts['took_rank']} took a rank, {counts['exited']} exited while waiting")


def nccl_timings(run_dir: Path) -> dict[tuple[str, str], list[int]]:
    """Each node's newest NCCL shim self-check messages, with the ranks that reported them."""
    newest: dict[tuple[str, int], str] = {}
    for event in read_events(run_dir):
        if event.get("kind") == NCCL_TIMINGS_KIND:
            newest[(str(event.get("node", "?")), int(event.get("rank", -1)))] = str(
                event.get("message", ""))
    grouped: dict[tuple[str, str], list[int]] = {}
    for (node, rank), message in sorted(newest.items()):
        grouped.setdefault((node, message), []).append(rank)
    return grouped


def format_nccl_timings(grouped: dict[tuple[str, str], list[int]]) -> str:
    if not grouped:
        return "NCCL timings: no report (no NCCL shim in this run)"
    return "\n".join(f"{message} ({node}, rank {','.join(map(str, ranks))})"
                     for (node, message), ranks in grouped.items())


def _status(args: argparse.Namespace) -> int:
    if not args.rdzv_id and args.run_dir is None:
        raise CliError("no job id; give --rdzv-id (the job's --rdzv-id) or set PET_RDZV_ID, "
                       "or --run-dir DIR for a run's detections")
    if args.run_dir is not None and not args.run_dir.is_dir():
        raise CliError(f"--run-dir {args.run_dir} is not a directory; give the run's --run-dir")
    output: dict[str, Any] = {}
    text = []
    if args.rdzv_id:
        client, settings = connect(args)
        try:
            status = read_status(client, Keys(settings.root, args.rdzv_id), settings)
        except connection_error() as e:
            raise one_line(e) from None
        finally:
            client.close()
        output.update(status.to_json())
        text.append(format_status(status))
    if args.run_dir is not None:
        output["workers"] = processes = worker_processes(args.run_dir)
        text.append(format_worker_processes(processes))
        detections = recent_detections(args.run_dir, args.detections)
        output["detections"] = [
            {k: e.get(k) for k in ("time", "node", "detector", "message")} for e in detections
        ]
        text.append(format_detections(detections, args.run_dir))
        found, restarts = recoveries(args.run_dir)
        output["recoveries"] = {"in_process": found, "restarts": restarts}
        text.append(format_recoveries(found, restarts))
        output["spares"] = spare_counts = spares(args.run_dir)
        if spare_counts["started"]:
            text.append(format_spares(spare_counts))
        timings = nccl_timings(args.run_dir)
        output["nccl_timings"] = [{"node": node, "message": message, "ranks": ranks}
                                  for (node, message), ranks in timings.items()]
        text.append(format_nccl_timings(timings))
        skipped, line = snapshots_skipped_line(read_events(args.run_dir))
        output["snapshots_skipped"] = skipped
        text.append(line)
        sdc, line = sdc_line(read_events(args.run_dir))
        output["sdc"] = sdc
        text.append(line)
    print(json.dumps(output, indent=2) if args.json else "\n".join(text))
    return 0
