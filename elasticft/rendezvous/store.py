"""A torch ``Store`` kept in etcd, for the agents of a job that rendezvous through etcd.

With torch's c10d rendezvous the agents' store (rank assignment, the round's ``MASTER_ADDR``,
the exit barrier) is a TCPStore inside one agent, so losing that node loses the job. This store
keeps the same keys in etcd under ``<root>/jobs/<run_id>/store/``: any node can die and the
others still find everything. Workers keep torch's own per-attempt TCPStore (hosted by worker
rank 0 and recreated every attempt), which is not job-critical: the next round makes a new one.

Blocking reads wait on an etcd watch started at the revision of the read that found the key
missing, so no write in between can be missed (``get`` first reads it again for a few seconds,
see :data:`REREAD_FOR_S`). Values are bytes; counters (``add``) are decimal text as in TCPStore.
"""

from __future__ import annotations

import threading
import time
import weakref
from collections.abc import Sequence
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from elasticft.rendezvous.etcd import EtcdSettings, etcd_errors, watch_once

_TXN_MAX_OPS = 128
"""etcd's default ``--max-txn-ops``: a transaction may hold no more operations."""

REREAD_PAUSE_S = (0.1, 1.0)
REREAD_FOR_S = 10.0
"""``get`` of a missing key reads it again after a pause that doubles from 0.1 s to 1 s, for up
to 10 s, and only then waits with an etcd watch. The key every node of a round gets,
``MASTER_ADDR``, is written by rank 0 as soon as it learns the round's result, about a poll
period after the others: a re-read costs one request, where a watch costs a stream, and in
Python's gRPC a thread that wakes ten times a second while it waits. With 1,024 agents on two
cores, a thousand such threads waiting for rank 0 kept rank 0 itself from running for seconds
(docs/scale.md). ``wait`` (the JIT request watcher, the exit barrier: long waits) goes to the
watch at once."""


def _as_bytes(value: str | bytes | bytearray) -> bytes:
    return value.encode() if isinstance(value, str) else bytes(value)


class EtcdStore(dist.Store):
    """torch Store over etcd keys ``prefix + key``."""

    def __init__(
        self,
        client: Any,
        prefix: str,
        settings: EtcdSettings,
        timeout: timedelta = timedelta(seconds=300),
    ) -> None:
        super().__init__()
        self._client = client
        self._prefix = prefix
        self._settings = settings
        self._watches: dict[threading.Thread, Any] = {}  # a thread's watch call in flight
        # Threads, not their ids: an id is reused by a later thread, which must not inherit it.
        self._interrupted: weakref.WeakSet[threading.Thread] = weakref.WeakSet()
        self.set_timeout(timeout)

    def _key(self, key: str) -> str:
        return self._prefix + key

    # -- writes ---------------------------------------------------------------------------------

    def set(self, key: str, value: str | bytes) -> None:
        with etcd_errors(self._settings, f"setting store key {key!r} in"):
            self._client.put(self._key(key), _as_bytes(value))

    def add(self, key: str, amount: int) -> int:
        full = self._key(key)
        txn = self._client.transactions
        while True:
            with etcd_errors(self._settings, f"adding to store key {key!r} in"):
                value, meta = self._client.get(full)
                current = int(value) if value else 0
                new = current + int(amount)
                condition = (
                    txn.create(full) == 0 if meta is None else txn.mod(full) == meta.mod_revision
                )
                ok, _ = self._client.transaction(
                    compare=[condition], success=[txn.put(full, str(new).encode())], failure=[]
                )
            if ok:
                return new

    def compare_set(self, key: str, expected: str | bytes, desired: str | bytes) -> bytes:
        """TCPStore semantics: set when the value equals ``expected`` (or, with an empty
        ``expected``, when the key is absent); return the value the key holds afterwards."""
        full = self._key(key)
        expected_b, desired_b = _as_bytes(expected), _as_bytes(desired)
        txn = self._client.transactions
        condition = txn.create(full) == 0 if not expected_b else txn.value(full) == expected_b
        with etcd_errors(self._settings, f"compare-and-set of store key {key!r} in"):
            ok, responses = self._client.transaction(
                compare=[condition], success=[txn.put(full, desired_b)], failure=[txn.get(full)]
            )
        if ok:
            return desired_b
        current = responses[0]
        return current[0][0] if current else expected_b

    def delete_key(self, key: str) -> bool:
        with etcd_errors(self._settings, f"deleting store key {key!r} in"):
            return bool(self._client.delete(self._key(key)))

    # -- reads ----------------------------------------------------------------------------------

    def check(self, keys: Sequence[str]) -> bool:
        return all(value is not None for value in self._read_many(keys, "checking"))

    def multi_get(self, keys: Sequence[str]) -> list[bytes]:
        values = self._read_many(keys, "reading")
        # Keys not there yet are waited for as get waits; present ones cost no second read.
        return [value if value is not None else self.get(key)
                for key, value in zip(keys, values, strict=True)]

    def get(self, key: str) -> bytes:
        # A key that is there (the common case) costs one request.
        return self._wait_for(key, self._deadline(None), REREAD_FOR_S)

    def wait(self, keys: Sequence[str], timeout: timedelta | None = None) -> None:
        deadline = self._deadline(timeout)
        for key in keys:
            self._wait_for(key, deadline, reread_for_s=0.0)

    def interrupt_waits(self, thread: threading.Thread) -> None:
        """Ends the blocking read of ``thread`` in this store now (or its next one, at once)
        with DistStoreError. A thread that waits for a key a whole round long (the JIT
        request watcher) then needs no short slices to notice it should stop: on etcd each
        slice costs a request."""
        self._interrupted.add(thread)
        call = self._watches.get(thread)
        if call is not None:
            call.cancel()

    def num_keys(self) -> int:
        with etcd_errors(self._settings, "counting store keys in"):
            return sum(1 for _ in self._client.get_prefix(self._prefix, keys_only=True))

    # -- helpers --------------------------------------------------------------------------------

    def _read_many(self, keys: Sequence[str], doing: str) -> list[bytes | None]:
        """The values of ``keys`` (None where absent), in one etcd transaction per
        :data:`_TXN_MAX_OPS` keys instead of one request per key: every agent reads every
        other node's diagnostics summary twice a second."""
        txn = self._client.transactions
        values: list[bytes | None] = []
        for start in range(0, len(keys), _TXN_MAX_OPS):
            chunk = keys[start:start + _TXN_MAX_OPS]
            with etcd_errors(self._settings, f"{doing} store keys in"):
                _, responses = self._client.transaction(
                    compare=[], success=[txn.get(self._key(k)) for k in chunk], failure=[])
            values.extend(found[0][0] if found else None for found in responses)
        return values

    def _deadline(self, timeout: timedelta | None) -> float:
        span = timeout if timeout is not None else self.timeout
        return time.monotonic() + span.total_seconds()

    def _wait_for(self, key: str, deadline: float, reread_for_s: float) -> bytes:
        """``key``'s value once it exists (read again for ``reread_for_s``, then watched);
        raises torch's DistStoreError at ``deadline``. A watch that ends without a change
        needs no read after it: the key is still missing at the revision watched from."""
        full = self._key(key)
        reread_until = time.monotonic() + reread_for_s
        pause_s = REREAD_PAUSE_S[0]
        missing_at: int | None = None  # the revision a read found the key missing at
        me = threading.current_thread()
        while True:
            if me in self._interrupted:
                self._interrupted.discard(me)
                raise dist.DistStoreError(f"waiting for store key {key!r} was interrupted")
            if missing_at is None:
                with etcd_errors(self._settings, f"reading store key {key!r} from"):
                    response = self._client.get_response(full)
                if response.count > 0:
                    return bytes(response.kvs[0].value)
                missing_at = response.header.revision
            now = time.monotonic()
            if now >= deadline:
                raise dist.DistStoreError(
                    f"timed out waiting for store key {key!r} in etcd "
                    f"({self._settings.endpoint_text})"
                )
            if now < reread_until:
                time.sleep(min(pause_s, deadline - now))
                pause_s = min(2 * pause_s, REREAD_PAUSE_S[1])
                missing_at = None
                continue
            # Wake at least every few seconds: a watch can die silently with its stream (etcd
            # restart); on a change (or a compacted revision) the key is read again.
            try:
                with etcd_errors(self._settings, f"watching store key {key!r} in"):
                    if watch_once(self._client, full, missing_at + 1, min(deadline - now, 5.0),
                                  on_call=lambda call: self._watching(me, call)):
                        missing_at = None
            finally:
                self._watches.pop(me, None)

    def _watching(self, thread: threading.Thread, call: Any) -> None:
        self._watches[thread] = call
        if thread in self._interrupted:  # interrupted just before the call existed
            call.cancel()
