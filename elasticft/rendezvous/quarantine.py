"""Quarantine: a node that disappeared from a job is kept out of that job for a while.

Two kinds of verdict keep a node out of the ``etcd-v3`` rendezvous, and they differ in what
they are about:

* The **blacklist** (:class:`elasticft.rendezvous.membership.Blacklist`) is evidence about a
  *machine*: a failed NVML or ECC check, a failed preflight, a node that kept failing, an
  operator's entry. It names the host, holds for every job on the cluster and lasts until
  ``elasticft blacklist remove``.
* A **quarantine** is what a job knows when one of its agents *disappeared* (its lease ended
  without a word, or the leader ended it on evidence that the agent is dead): nothing about the
  machine, only that this node, in this job, went away. It names the node id, holds for this
  job only and ends by itself after :data:`DEFAULT_QUARANTINE_S` (the entry is on an etcd
  lease of that TTL). A machine that rebooted after a kernel panic rejoins once it is over.

Whom a quarantine refuses (:func:`refuses`, pure):

* only a node with the same id, in the same job (the entry lives under the job's keys);
* not a *per-process* id (``<host>-2``, ``<host>-3``: the second, third live agent of the job on
  a host, :mod:`elasticft.rendezvous.identity`). Such a name belongs to whichever process claims
  it next, not to a machine or to the agent that disappeared, so the entry only records what
  happened (``elasticft blacklist list`` shows it);
* not the very agent that was declared gone while it was alive (its lease was ended on
  evidence that turned out false, or it was cut off for longer than the TTL): it took part in
  the round the quarantine names, which an agent started since cannot have, so it rejoins at
  once and resumes from the newest snapshot.

Key: ``<root>/quarantine/<run_id>/<node_id>`` (JSON, on a lease of the quarantine's TTL).
"""

from __future__ import annotations

import dataclasses
import logging
import re
import time
from collections.abc import Callable
from typing import Any

from elasticft.rendezvous.etcd import EtcdSettings, Keys, etcd_errors, quarantine_prefix
from elasticft.rendezvous.membership import dump_record, parse_record
from elasticft.torch_compat import RendezvousError

logger = logging.getLogger(__name__)

DEFAULT_QUARANTINE_S = 300.0
"""How long a node that disappeared is kept out of its job (``recovery_quarantine_s``)."""
POLL_S = 5.0
"""How often a quarantined node looks whether its quarantine is over."""


@dataclasses.dataclass(frozen=True)
class QuarantineEntry:
    node_id: str
    reason: str
    round: int
    """The last round the node took part in before it disappeared."""
    added_by: str = ""
    added_at: float = 0.0
    until: float = 0.0

    def summary(self) -> str:
        until = time.strftime("%H:%M:%S", time.localtime(self.until))
        by = f" by {self.added_by}" if self.added_by else ""
        return f"{self.node_id}: {self.reason} (quarantined{by} until {until})"


def is_per_process_id(node_id: str, host: str) -> bool:
    """Whether ``node_id`` is a second (third, ...) agent's default name on ``host``."""
    return re.fullmatch(re.escape(host) + r"-\d+", node_id) is not None


def machine_name(node_id: str, host: str) -> str:
    """The name evidence about this node's machine blacklists: the host for a per-process id
    (which names no machine), else the node id (the host name, or the operator's own name)."""
    return host if is_per_process_id(node_id, host) else node_id


def refuses(entry: QuarantineEntry | None, node_id: str, host: str, last_round: int) -> bool:
    """Whether ``entry`` keeps out the agent ``node_id`` on ``host`` whose last round as a
    participant was ``last_round`` (-1: none yet, a new agent)."""
    if entry is None or entry.node_id != node_id or is_per_process_id(node_id, host):
        return False
    return last_round < entry.round


class NodeQuarantinedError(RendezvousError):
    """This node's id is quarantined in this job for longer than its join timeout."""

    def __init__(self, message: str, reason: str) -> None:
        super().__init__(message)
        self.reason = reason


def wait_out(raw: bytes | None, again: Callable[[], bytes | None], node_id: str, host: str,
             last_round: int, run_id: str, deadline: float, endpoint: str) -> None:
    """Waits while the quarantine entry ``raw`` (read again by ``again()``) keeps this node out
    (:func:`refuses`); raises :class:`NodeQuarantinedError` when it outlasts ``deadline``
    (``time.monotonic()``)."""
    said = False
    while refuses(entry := parse(raw), node_id, host, last_round):
        assert entry is not None
        left = entry.until - time.time()
        if time.monotonic() + left > deadline:
            raise NodeQuarantinedError(
                f"node {node_id!r} is quarantined in job {run_id!r} for another {left:.0f} s "
                f"({entry.reason}); start it again after that, or end the quarantine now with "
                f"`elasticft blacklist remove {node_id} --run-id {run_id} --rdzv-endpoint "
                f"{endpoint}`", reason=entry.reason)
        if not said:
            logger.warning("node %s is quarantined in job %s for another %.0f s (%s); it joins "
                           "after that", node_id, run_id, left, entry.reason)
            said = True
        time.sleep(min(POLL_S, max(0.1, left)))
        raw = again()


def parse(value: bytes | None) -> QuarantineEntry | None:
    return parse_record(QuarantineEntry, value)


class Quarantine:
    """The quarantine entries of one job."""

    def __init__(self, client: Any, keys: Keys, settings: EtcdSettings) -> None:
        self._client = client
        self._keys = keys
        self._settings = settings

    def add(self, node_id: str, reason: str, round_: int, added_by: str,
            seconds: float = DEFAULT_QUARANTINE_S) -> QuarantineEntry:
        now = time.time()
        entry = QuarantineEntry(node_id, reason, round_, added_by, now, now + seconds)
        with etcd_errors(self._settings, "writing the quarantine to"):
            lease = self._client.lease(max(1, round(seconds)))
            self._client.put(self._keys.quarantined(node_id), dump_record(entry), lease=lease)
        logger.info("node %s quarantined in job %s for %.0f s: %s", node_id, self._keys.run_id,
                    seconds, reason)
        return entry

    def get(self, node_id: str) -> QuarantineEntry | None:
        with etcd_errors(self._settings, "reading the quarantine from"):
            value, _ = self._client.get(self._keys.quarantined(node_id))
        return parse(value)

    def remove(self, node_id: str) -> bool:
        with etcd_errors(self._settings, "writing the quarantine to"):
            return bool(self._client.delete(self._keys.quarantined(node_id)))

    def entries(self) -> list[QuarantineEntry]:
        with etcd_errors(self._settings, "reading the quarantine from"):
            found = list(self._client.get_prefix(self._keys.quarantine))
        entries = [parse(value) for value, _ in found]
        return sorted((e for e in entries if e is not None), key=lambda e: e.node_id)


def all_entries(client: Any, root: str, settings: EtcdSettings
                ) -> list[tuple[str, QuarantineEntry]]:
    """Every job's quarantine entries under ``root``, as (job, entry)."""
    prefix = quarantine_prefix(root)
    with etcd_errors(settings, "reading the quarantine from"):
        found = list(client.get_prefix(prefix))
    entries = []
    for value, meta in found:
        job = meta.key.decode()[len(prefix):].rpartition("/")[0]
        if (entry := parse(value)) is not None:
            entries.append((job, entry))
    return sorted(entries, key=lambda e: (e[0], e[1].node_id))
