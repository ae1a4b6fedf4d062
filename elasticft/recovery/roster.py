"""The job's roster as recovery reads it: who is alive, who waits as a standby, who is banned.

Only the ``etcd-v3`` rendezvous keeps these facts outside the training nodes (membership records
on agent leases, a blacklist of machines without lease, the job's quarantine of nodes that
disappeared, see :mod:`elasticft.rendezvous.membership` and
:mod:`elasticft.rendezvous.quarantine`); with any other backend recovery works without them
(no blacklist, no quarantine, no standby count).
"""

from __future__ import annotations

import logging
from typing import Any, Protocol

from elasticft.rendezvous.etcd import EtcdSettings, Keys, LazyClient
from elasticft.rendezvous.membership import Blacklist, read_status
from elasticft.rendezvous.quarantine import Quarantine

logger = logging.getLogger(__name__)


class Roster(Protocol):
    def alive(self, node_id: str) -> bool: ...

    def standbys(self) -> int: ...

    def is_blacklisted(self, node_id: str) -> bool: ...

    def blacklist(self, node_id: str, reason: str, added_by: str) -> None: ...

    def quarantine(self, node_id: str, reason: str, round_: int, added_by: str,
                   seconds: float) -> None: ...


class EtcdRoster:
    """:class:`Roster` over the job's etcd keys; every call is one or two reads."""

    def __init__(self, settings: EtcdSettings, run_id: str) -> None:
        self._settings = settings
        self._keys = Keys(settings.root, run_id)
        self._client = LazyClient(settings)
        self._blacklist = Blacklist(self._client, settings.root, settings)

    @classmethod
    def from_launch_config(cls, config: Any) -> EtcdRoster | None:
        if getattr(config, "rdzv_backend", None) != "etcd-v3":
            return None
        try:
            settings = EtcdSettings.from_conf(config.rdzv_endpoint, dict(config.rdzv_configs))
        except ValueError as e:
            logger.warning("recovery runs without the roster: %s", e)
            return None
        return cls(settings, str(config.run_id))

    def alive(self, node_id: str) -> bool:
        value, _ = self._client.get(self._keys.member(node_id))
        return value is not None

    def standbys(self) -> int:
        return len(read_status(self._client, self._keys, self._settings).standbys)

    def is_blacklisted(self, node_id: str) -> bool:
        """On the blacklist, or already quarantined in this job."""
        return self._blacklist.get(node_id) is not None or Quarantine(
            self._client, self._keys, self._settings).get(node_id) is not None

    def blacklist(self, node_id: str, reason: str, added_by: str) -> None:
        self._blacklist.add(node_id, reason, added_by)

    def quarantine(self, node_id: str, reason: str, round_: int, added_by: str,
                   seconds: float) -> None:
        Quarantine(self._client, self._keys, self._settings).add(node_id, reason, round_,
                                                                 added_by, seconds)

    def close(self) -> None:
        self._client.close()
