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

**Back-off after a lost write.** torch retries a lost CAS at once: it decodes the state this
backend returns, re-applies its change and writes again. When N agents join together every won
write makes the other N-1 lose, so a round costs O(N²) writes and as many decode/re-encode
cycles (docs/scale.md). After a lost write this backend therefore sleeps a random time drawn
from ``[0, min(cap, base * 2**(losses-1))]`` ("full jitter"; ``losses`` counts consecutive lost
writes of this agent and resets on a won one), then returns a fresh read of the state, which is
what torch's contract asks for a lost write (the current state and its token). A first loss
waits at most ``base`` (10 ms), so rounds of a few nodes are not slowed; the cap (0.5 s) bounds
the added latency of a crowded round. :func:`cas_backoff_s` is the policy, a pure function.
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Callable
from typing import Any

from elasticft.rendezvous.etcd import EtcdSettings, etcd_errors
from elasticft.torch_compat import RendezvousBackend, Token

logger = logging.getLogger(__name__)

BACKEND_NAME = "etcd-v3"

CAS_BACKOFF_BASE_S = 0.01
CAS_BACKOFF_CAP_S = 0.5


def cas_backoff_s(
    consecutive_losses: int,
    draw: float,
    base_s: float = CAS_BACKOFF_BASE_S,
    cap_s: float = CAS_BACKOFF_CAP_S,
) -> float:
    """Seconds to wait after the ``consecutive_losses``-th lost CAS in a row (0: none lost).

    ``draw`` is a uniform random number in [0, 1): the wait is ``draw`` times a ceiling that
    doubles with every loss from ``base_s`` up to ``cap_s`` (full jitter, so that writers that
    lost together spread out instead of colliding again).
    """
    if consecutive_losses <= 0:
        return 0.0
    # The exponent is bounded so that a long losing streak cannot overflow the float.
    ceiling = min(cap_s, base_s * 2.0 ** min(consecutive_losses - 1, 32))
    return min(max(draw, 0.0), 1.0) * ceiling


class EtcdRendezvousBackend(RendezvousBackend):
    """Rendezvous state in etcd key ``key``; see the module docstring for the CAS contract."""

    def __init__(
        self,
        client: Any,
        key: str,
        settings: EtcdSettings,
        sleep: Callable[[float], None] = time.sleep,
        draw: Callable[[], float] = random.random,
    ) -> None:
        self._client = client
        self._key = key
        self._settings = settings
        self._sleep = sleep
        self._draw = draw
        self._consecutive_losses = 0

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
        if succeeded:
            self._consecutive_losses = 0
            return value, meta.mod_revision, True
        self._consecutive_losses += 1
        delay_s = cas_backoff_s(self._consecutive_losses, self._draw())
        logger.debug(
            "rendezvous CAS lost (token %s, now %s, %d in a row): waiting %.3f s",
            token, meta.mod_revision, self._consecutive_losses, delay_s,
        )
        if delay_s <= 0:
            return value, meta.mod_revision, False
        self._sleep(delay_s)
        # Others wrote while we waited: hand back the state as it is now, not as it was.
        fresh = self.get_state()
        if fresh is None:
            return None
        return fresh[0], fresh[1], False
