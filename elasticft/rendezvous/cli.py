"""``elasticft blacklist list|add|remove``: the nodes the etcd-v3 rendezvous refuses.

Two kinds (:mod:`elasticft.rendezvous.quarantine`): blacklisted machines, for every job until
removed, and nodes quarantined in one job after they disappeared from it, until the quarantine
ends by itself (or ``remove NODE --run-id JOB``). ``list`` shows both.

It takes the same connection flags as ``elasticft-run`` (``--rdzv-endpoint``, ``--rdzv-conf`` for
TLS/user/password/prefix; ``PET_RDZV_ENDPOINT`` / ``PET_RDZV_CONF`` when the flags are left out),
so a job's own settings can be reused verbatim. :func:`add_connection_flags` and :func:`connect`
serve ``elasticft status`` (:mod:`elasticft.report.status`) too.
"""

from __future__ import annotations

import argparse
import dataclasses
import getpass
import json
import os
import socket
from typing import Any

from elasticft.cli import CliError
from elasticft.rendezvous.etcd import (
    EtcdConfigError,
    EtcdSettings,
    Keys,
    LazyClient,
    connection_error,
)
from elasticft.rendezvous.membership import Blacklist


def add_connection_flags(parser: argparse.ArgumentParser) -> None:
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


def connect(args: argparse.Namespace) -> tuple[Any, EtcdSettings]:
    """A client of the etcd named by the connection flags, and its settings."""
    try:
        settings = EtcdSettings.from_conf(args.rdzv_endpoint, _parse_conf(args.rdzv_conf))
    except EtcdConfigError as e:
        raise CliError(str(e)) from None
    return LazyClient(settings), settings


def one_line(error: Exception) -> CliError:
    """A connection failure as a user error: its first line, no traceback."""
    return CliError(str(error).splitlines()[0])


def register(subparsers: argparse._SubParsersAction) -> None:
    blacklist = subparsers.add_parser(
        "blacklist", help="list, add or remove nodes refused by the etcd-v3 rendezvous"
    )
    actions = blacklist.add_subparsers(dest="blacklist_action", required=True, metavar="ACTION")
    listing = actions.add_parser(
        "list", help="show blacklisted machines and quarantined nodes (per job), and why")
    listing.add_argument("--json", action="store_true", help="print JSON")
    add = actions.add_parser("add", help="refuse NODE_ID at its next rendezvous")
    add.add_argument("node_id")
    add.add_argument("--reason", required=True, help="why (shown to the refused node)")
    remove = actions.add_parser(
        "remove", help="let NODE_ID join again (with --run-id: end its quarantine in that job)")
    remove.add_argument("node_id")
    remove.add_argument("--run-id", help="the job whose quarantine of NODE_ID ends now")
    for sub in (listing, add, remove):
        add_connection_flags(sub)
        sub.set_defaults(handler=_blacklist)


def _blacklist(args: argparse.Namespace) -> int:
    # The quarantine's error class is torch's (a rendezvous error): imported here, not by
    # ``elasticft status``, which shares this module's connection flags and reads no quarantine.
    from elasticft.rendezvous.quarantine import Quarantine, all_entries

    client, settings = connect(args)
    blacklist = Blacklist(client, settings.root, settings)
    try:
        if args.blacklist_action == "add":
            if "/" in args.node_id:
                raise CliError(f"node id {args.node_id!r} contains '/'; give the node's name")
            by = f"{getpass.getuser()}@{socket.gethostname()}"
            blacklist.add(args.node_id, args.reason, added_by=by)
            print(f"blacklisted {args.node_id}: {args.reason}")
        elif args.blacklist_action == "remove" and args.run_id:
            keys = Keys(settings.root, args.run_id)
            if not Quarantine(client, keys, settings).remove(args.node_id):
                raise CliError(
                    f"node {args.node_id!r} is not quarantined in job {args.run_id!r}; "
                    "see `elasticft blacklist list`")
            print(f"ended the quarantine of {args.node_id} in job {args.run_id}")
        elif args.blacklist_action == "remove":
            if not blacklist.remove(args.node_id):
                raise CliError(
                    f"node {args.node_id!r} is not on the blacklist; "
                    "see `elasticft blacklist list`"
                )
            print(f"removed {args.node_id} from the blacklist")
        else:
            entries = blacklist.entries()
            quarantined = all_entries(client, settings.root, settings)
            if args.json:
                print(json.dumps({
                    "blacklist": [dataclasses.asdict(e) for e in entries],
                    "quarantine": [{"run_id": job, **dataclasses.asdict(e)}
                                   for job, e in quarantined]}, indent=2))
                return 0
            print("blacklist (machines, every job):" if entries else "blacklist is empty")
            for entry in entries:
                print(f"  {entry.summary()}")
            print("quarantine (nodes, one job each):" if quarantined else "quarantine is empty")
            for job, q in quarantined:
                print(f"  job {job}: {q.summary()}")
    except connection_error() as e:
        raise one_line(e) from None
    finally:
        client.close()
    return 0
