"""The ``etcd-v3`` rendezvous backend: torch's rendezvous state in one etcd key, set by CAS.

torch's :class:`DynamicRendezvousHandler` keeps the whole rendezvous state (round, participants,
wait and redundancy lists, heartbeats) as one opaque blob and needs two things from a backend:
read it with a *fencing token*, and write it only if nobody wrote since that token. Here the
token is the key's ``mod_revision`` and the write is one etcd transaction::

    if mod_revision(key) == token (or, with no token, the key does not exist):
        put(key, new); get(key)      -> (new, its revision, True)
    else:
        get(key)                     -> (current, its revision, False)

The new token comes from the same transaction, so a writer can never pair a value with the
wrong revision, and a writer holding a stale token (a node that was partitioned away, a
zombie agent) can never overwrite newer state.
"""

from __future__ import annotations

import logging
from typing import Any

from elasticft.rendezvous.etcd import EtcdSettings, etcd_errors
from elasticft.torch_compat import RendezvousBackend, Token

logger = logging.getLogger(__name__)

BACKEND_NAME = "etcd-v3"


class EtcdRendezvousBackend(RendezvousBackend):
    """Rendezvous state in etcd key ``key``; see the module docstring for the CAS contract."""

    def __init__(self, client: Any, key: str, settings: EtcdSettings) -> None:
        self._client = client
        self._key = key
        self._settings = settings

    @property
    def name(self) -> str:
        return BACKEND_NAME

    @property
    def key(self) -> str:
        return self._key

    def get_state(self) -> tuple[bytes, Token] | None:
        with etcd_errors(self._settings, "reading the rendezvous state from"):
            value, meta = self._client.get(self._key)
        if value is None:
            return None
        return value, meta.mod_revision

    def set_state(
        self, state: bytes, token: Token | None = None
    ) -> tuple[bytes, Token, bool] | None:
        txn = self._client.transactions
        if token is None:
            condition = txn.create(self._key) == 0
        elif isinstance(token, int) and token > 0:
            condition = txn.mod(self._key) == token
        else:
            # Not a token this backend handed out: it can only lose, and it reads the truth.
            condition = txn.mod(self._key) == -1
        with etcd_errors(self._settings, "writing the rendezvous state to"):
            succeeded, responses = self._client.transaction(
                compare=[condition],
                success=[txn.put(self._key, state), txn.get(self._key)],
                failure=[txn.get(self._key)],
            )
        current = responses[-1]
        if not current:
            # The key vanished (deleted by hand): the caller starts from a fresh state.
            return None
        value, meta = current[0]
        if not succeeded:
            logger.debug("rendezvous CAS lost (token %s, now %s)", token, meta.mod_revision)
        return value, meta.mod_revision, bool(succeeded)
