"""``elasticft blacklist list|add|remove`` and ``elasticft status``: membership, read from etcd.

Both take the same connection flags as ``elasticft-run`` (``--rdzv-endpoint``, ``--rdzv-conf``
for TLS/user/password/prefix; ``PET_RDZV_ENDPOINT`` / ``PET_RDZV_CONF`` / ``PET_RDZV_ID`` when
the flags are left out), so a job's own settings can be reused verbatim. ``elasticft status
--run-dir DIR`` adds the newest diagnostics detections from the run's event log (alone, for a
``--standalone`` run without etcd, it shows only those).
"""

from __future__ import annotations

import argparse
import getpass
import json
import os
import socket
import time
from pathlib import Path
from typing import Any

from elasticft.cli import CliError
from elasticft.events import read_events, snapshots_skipped_line
from elasticft.rendezvous.etcd import EtcdConfigError, EtcdSettings, Keys, LazyClient
from elasticft.rendezvous.membership import Blacklist, JobStatus, MemberRecord, read_status
from elasticft.torch_compat import RendezvousConnectionError


def _add_connection_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--rdzv-endpoint",
        default=os.environ.get("PET_RDZV_ENDPOINT", ""),
        help="etcd endpoint(s) HOST:PORT[,HOST:PORT...] (env PET_RDZV_ENDPOINT)",
    )
    parser.add_argument(
        "--rdzv-conf",
        default=os.environ.get("PET_RDZV_CONF", ""),
        help="k=v,... as given to elasticft-run: prefix, protocol, ca_cert, cert, key, user, "
        "password_file, rpc_timeout (env PET_RDZV_CONF)",
    )


def _parse_conf(text: str) -> dict[str, str]:
    conf = {}
    for item in text.split(","):
        if not item.strip():
            continue
        key, sep, value = item.partition("=")
        if not sep:
            raise CliError(f"--rdzv-conf item {item!r} is not KEY=VALUE")
        conf[key.strip()] = value.strip()
    return conf


def _connect(args: argparse.Namespace) -> tuple[Any, EtcdSettings]:
    try:
        settings = EtcdSettings.from_conf(args.rdzv_endpoint, _parse_conf(args.rdzv_conf))
    except EtcdConfigError as e:
        raise CliError(str(e)) from None
    return LazyClient(settings), settings


def _one_line(error: RendezvousConnectionError) -> CliError:
    return CliError(str(error).splitlines()[0])


def register(subparsers: argparse._SubParsersAction) -> None:
    blacklist = subparsers.add_parser(
        "blacklist", help="list, add or remove nodes refused by the etcd-v3 rendezvous"
    )
    actions = blacklist.add_subparsers(dest="blacklist_action", required=True, metavar="ACTION")
    listing = actions.add_parser("list", help="show blacklisted nodes and why")
    listing.add_argument("--json", action="store_true", help="print JSON")
    add = actions.add_parser("add", help="refuse NODE_ID at its next rendezvous")
    add.add_argument("node_id")
    add.add_argument("--reason", required=True, help="why (shown to the refused node)")
    remove = actions.add_parser("remove", help="let NODE_ID join again")
    remove.add_argument("node_id")
    for sub in (listing, add, remove):
        _add_connection_flags(sub)
        sub.set_defaults(handler=_blacklist)

    status = subparsers.add_parser(
        "status",
        help="a job's round, leader, participants, standbys and the blacklist (etcd); with "
        "--run-dir, its newest diagnostics detections",
    )
    status.add_argument(
        "--rdzv-id", default=os.environ.get("PET_RDZV_ID", ""), help="the job id (env PET_RDZV_ID)"
    )
    status.add_argument("--json", action="store_true", help="print JSON")
    status.add_argument(
        "--run-dir", type=Path, help="also show the newest diagnostics detections of this run "
        "(its --run-dir); alone, without --rdzv-id, only those"
    )
    status.add_argument(
        "--detections", type=int, default=10, metavar="N", help="how many detections (default 10)"
    )
    _add_connection_flags(status)
    status.set_defaults(handler=_status)


def _blacklist(args: argparse.Namespace) -> int:
    client, settings = _connect(args)
    blacklist = Blacklist(client, settings.root, settings)
    try:
        if args.blacklist_action == "add":
            if "/" in args.node_id:
                raise CliError(f"node id {args.node_id!r} contains '/'; give the node's name")
            by = f"{getpass.getuser()}@{socket.gethostname()}"
            blacklist.add(args.node_id, args.reason, added_by=by)
            print(f"blacklisted {args.node_id}: {args.reason}")
        elif args.blacklist_action == "remove":
            if not blacklist.remove(args.node_id):
                raise CliError(
                    f"node {args.node_id!r} is not on the blacklist; "
                    "see `elasticft blacklist list`"
                )
            print(f"removed {args.node_id} from the blacklist")
        else:
            entries = blacklist.entries()
            if args.json:
                print(json.dumps([e.__dict__ for e in entries], indent=2))
            elif not entries:
                print("blacklist is empty")
            for entry in entries if not args.json else ():
                print(entry.summary())
    except RendezvousConnectionError as e:
        raise _one_line(e) from None
    finally:
        client.close()
    return 0


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


def nccl_timings(run_dir: Path) -> dict[tuple[str, str], list[int]]:
    """Each node's newest NCCL shim self-check messages, with the ranks that reported them."""
    newest: dict[tuple[str, int], str] = {}
    for event in read_events(run_dir):
        if event.get("kind") == "nccl_timings":
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
        client, settings = _connect(args)
        try:
            status = read_status(client, Keys(settings.root, args.rdzv_id), settings)
        except RendezvousConnectionError as e:
            raise _one_line(e) from None
        finally:
            client.close()
        output.update(status.to_json())
        text.append(format_status(status))
    if args.run_dir is not None:
        detections = recent_detections(args.run_dir, args.detections)
        output["detections"] = [
            {k: e.get(k) for k in ("time", "node", "detector", "message")} for e in detections
        ]
        text.append(format_detections(detections, args.run_dir))
        timings = nccl_timings(args.run_dir)
        output["nccl_timings"] = [{"node": node, "message": message, "ranks": ranks}
                                  for (node, message), ranks in timings.items()]
        text.append(format_nccl_timings(timings))
        skipped, line = snapshots_skipped_line(read_events(args.run_dir))
        output["snapshots_skipped"] = skipped
        text.append(line)
    print(json.dumps(output, indent=2) if args.json else "\n".join(text))
    return 0
