"""Builds the ``etcd-v3`` rendezvous handler from torchrun's rendezvous parameters: the
``--rdzv-endpoint``, ``--nnodes`` and ``--rdzv-conf`` keys, each checked with a one-line error
that names the key and the fix (:class:`~elasticft.rendezvous.etcd.EtcdConfigError`). Nothing
here talks to etcd: the handler connects on first use."""

from __future__ import annotations

import os
import socket
from datetime import timedelta

from elasticft.extras import require_etcd
from elasticft.rendezvous.etcd import EtcdConfigError, EtcdSettings, Keys, LazyClient
from elasticft.rendezvous.handler import (
    DISABLE_SHARED_STORE_ENV,
    EtcdParts,
    EtcdRendezvousHandler,
)
from elasticft.rendezvous.health import HealthCheck, basic_health_check
from elasticft.rendezvous.identity import claim_node_id
from elasticft.rendezvous.membership import Blacklist, MembershipPublisher
from elasticft.rendezvous.store import EtcdStore
from elasticft.torch_compat import RendezvousParameters, RendezvousTimeout


def _conf_int(params: RendezvousParameters, key: str, default: int) -> int:
    try:
        value = params.get_as_int(key, default)
    except ValueError:
        raise EtcdConfigError(
            f"--rdzv-conf {key}={params.get(key)!r} is not a whole number of seconds"
        ) from None
    return default if value is None else value


def _timeout(params: RendezvousParameters, name: str) -> timedelta | None:
    key = f"{name}_timeout"
    if params.get(key) is None:
        return None
    return timedelta(seconds=_conf_int(params, key, 0))


def create_handler(
    params: RendezvousParameters, health_check: HealthCheck = basic_health_check
) -> EtcdRendezvousHandler:
    """Builds the handler from torchrun's rendezvous parameters; does not contact etcd yet.

    ``--rdzv-conf`` keys: torch's (``join_timeout``, ``last_call_timeout``, ``close_timeout``,
    ``heartbeat_timeout``, ``keep_alive_interval``, ``keep_alive_max_attempt``), the connection
    keys of :meth:`EtcdSettings.from_conf`, and ``node_id`` (default: the host name for the
    job's first agent on a host, ``<host>-2`` for a second, see
    :mod:`~elasticft.rendezvous.identity`; set by elasticft-run from ``--node-id``),
    ``connect_timeout`` (default: the join timeout),
    ``store_timeout`` (agent store reads, default 300 s), ``share_tcp_store`` (default 0),
    ``rejoin_timeout`` (how long past the last call a round waits for the previous round's live
    participants, default 60 s).
    """
    require_etcd()
    settings = EtcdSettings.from_conf(params.endpoint, params.config)
    if not params.run_id or params.run_id == "none":
        raise EtcdConfigError("the etcd-v3 rendezvous needs a job id; give --rdzv-id NAME")
    keys = Keys(settings.root, params.run_id)
    explicit = params.get("node_id")
    if explicit is not None and ("/" in str(explicit) or not str(explicit).strip()):
        raise EtcdConfigError(f"node id {explicit!r} is not usable; give a name without '/'")
    # Unique among this job's live agents on this host (elasticft-run has claimed it already).
    claim = claim_node_id(params.run_id, str(explicit) if explicit else None,
                          endpoint=str(params.endpoint or ""))
    if not params.get_as_bool("share_tcp_store", False):
        # Workers then get a fresh store every attempt: the shared one deadlocks when a node
        # (a standby) joins a running job and keeps stale gloo addresses (pytorch#135712).
        os.environ.setdefault(DISABLE_SHARED_STORE_ENV, "1")

    keep_alive_interval = _conf_int(params, "keep_alive_interval", 5)
    keep_alive_max_attempt = _conf_int(params, "keep_alive_max_attempt", 3)
    if keep_alive_interval < 1 or keep_alive_max_attempt < 1:
        raise EtcdConfigError(
            "--rdzv-conf keep_alive_interval and keep_alive_max_attempt must be at least 1 "
            "(their product is the lease TTL: how soon a dead node is noticed)")
    rejoin_s = _conf_int(params, "rejoin_timeout", 60)
    if rejoin_s < 0:
        raise EtcdConfigError(f"--rdzv-conf rejoin_timeout={rejoin_s} is negative; give the "
                              "seconds a round waits for the previous round's nodes (0 or more)")
    try:
        timeout = RendezvousTimeout(
            _timeout(params, "join"),
            _timeout(params, "last_call"),
            _timeout(params, "close"),
            _timeout(params, "heartbeat"),
        )
    except ValueError as e:
        raise EtcdConfigError(f"--rdzv-conf: {e}; give a positive number of seconds") from None
    client = LazyClient(settings)
    store = EtcdStore(
        client, keys.store, settings, timedelta(seconds=_conf_int(params, "store_timeout", 300))
    )
    join_s = timeout.join.total_seconds()
    connect_timeout = _conf_int(params, "connect_timeout", int(join_s))
    parts = EtcdParts(
        client=client,
        settings=settings,
        keys=keys,
        node_id=claim.node_id,
        host=claim.host,
        claim=claim,
        blacklist=Blacklist(client, settings.root, settings),
        publisher=MembershipPublisher(
            client, keys, settings, ttl_s=keep_alive_interval * keep_alive_max_attempt
        ),
        health_check=health_check,
        connect_timeout_s=float(connect_timeout),
    )
    return EtcdRendezvousHandler(
        params.run_id,
        params.min_nodes,
        params.max_nodes,
        params.local_addr or socket.getfqdn(),
        timeout,
        store,
        parts,
        timedelta(seconds=rejoin_s),
    )
