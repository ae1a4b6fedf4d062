"""The rendezvous rounds in etcd: the few requests each node makes to join and wait for a round.

The decisions are in :mod:`elasticft.rendezvous.protocol`; this module is their I/O, one etcd
request each (a transaction of small operations), so that a round costs every node O(1)
requests whatever the number of nodes:

* :meth:`RoundStore.join` — leave the node's previous round (and say so with that round's
  ``restart`` key if it was a participant) and write its join key on its lease, in one
  transaction that also reads the previous round's result (the gate needs its size).
* :meth:`RoundStore.poll` — claim the round's coordinator key if it is free and read what the
  node needs: the result, the last completed round, the closed flag, whether its own join key
  is still there; the coordinator also counts the round's joins and the previous round's
  departures (``count_only`` ranges: the server counts, nothing is transferred).
* :meth:`RoundStore.close` — the coordinator reads the join keys once (O(N) keys, no values)
  and writes the result, exactly once: the transaction only succeeds while the result key does
  not exist and the job is not closed, and it advances ``rdzv/round`` in the same step.
* :meth:`RoundStore.running_view` — the running participants' one request per second.
"""

from __future__ import annotations

import dataclasses
import json
import time
from typing import Any

from elasticft.rendezvous.etcd import (
    EtcdSettings,
    Keys,
    delete_request,
    etcd_errors,
    put_request,
    range_request,
    raw_txn,
    txn_response,
    watch_once,
)
from elasticft.rendezvous.protocol import select_participants

PRUNE_BEHIND = 2
"""Closing round T deletes the keys of round T - 2."""


@dataclasses.dataclass(frozen=True)
class PollView:
    """What one poll of round ``round`` read."""

    round: int
    result: tuple[str, ...] | None
    last_round: int
    job_closed: bool
    joined_present: bool
    coordinator: str | None
    previous_restarted: bool
    """A participant of the previous round came back to rendezvous (its ``restart`` key)."""
    joined: int = 0
    """(coordinator only) Join keys of this round."""
    previous_remaining: int | None = None
    """(coordinator only) Join keys left in the previous round (its live participants)."""
    revision: int = 0
    """etcd's revision as of the poll: a watch from the next one misses no change."""


@dataclasses.dataclass(frozen=True)
class RunningView:
    last_round: int
    restart_requested: bool
    next_round_joined: int
    job_closed: bool
    round_remaining: int
    """Live join keys of the round (a lost participant's expired with its lease)."""


def parse_result(value: bytes | None) -> tuple[str, ...] | None:
    if not value:
        return None
    try:
        data = json.loads(value)
    except (ValueError, UnicodeDecodeError):
        return None
    participants = data.get("participants") if isinstance(data, dict) else None
    if not isinstance(participants, list):
        return None
    return tuple(str(p) for p in participants)


def _int(value: bytes | None, default: int) -> int:
    try:
        return int(value) if value else default
    except ValueError:
        return default


def _value(response: Any) -> bytes | None:
    kvs = response.response_range.kvs
    return kvs[0].value if kvs else None


def _count(response: Any) -> int:
    return int(response.response_range.count)


@dataclasses.dataclass(frozen=True)
class ProbeView:
    """What a join starts from (:meth:`RoundStore.probe`)."""

    blacklisted: bytes | None
    last_round: int
    member: bytes | None
    """The member record under this node's id: another live agent's if the id is taken."""
    quarantined: bytes | None = None
    """This node id's quarantine entry in this job (raw), if any."""


class RoundStore:
    """One node's requests against the rounds of one job."""

    def __init__(self, client: Any, keys: Keys, settings: EtcdSettings, node_id: str) -> None:
        self._client = client
        self._keys = keys
        self._settings = settings
        self._node_id = node_id

    def probe(self, blacklist_keys: tuple[str, ...]) -> ProbeView:
        """One request that proves etcd answers and reads what a join starts from: the
        blacklist entries (raw) of this node's names, the last completed round, the member
        record (raw) under this node's id and its quarantine entry (raw) in this job."""
        c, k = self._client, self._keys
        reads = [range_request(c, key) for key in blacklist_keys]
        reads += [range_request(c, k.last_round), range_request(c, k.member(self._node_id)),
                  range_request(c, k.quarantined(self._node_id))]
        with etcd_errors(self._settings, "connecting to"):
            _, responses = raw_txn(c, [], reads)
        entries = [_value(r) for r in responses[:len(blacklist_keys)]]
        return ProbeView(
            blacklisted=next((e for e in entries if e is not None), None),
            last_round=_int(_value(responses[-3]), -1),
            member=_value(responses[-2]),
            quarantined=_value(responses[-1]),
        )

    def last_round(self) -> int:
        """The last completed round (-1 before the first)."""
        with etcd_errors(self._settings, "reading the rendezvous round from"):
            value, _ = self._client.get(self._keys.last_round)
        return _int(value, -1)

    def is_closed(self) -> bool:
        with etcd_errors(self._settings, "reading the rendezvous state from"):
            value, _ = self._client.get(self._keys.closed)
        return value is not None

    def set_closed(self) -> None:
        with etcd_errors(self._settings, "closing the rendezvous in"):
            self._client.put(self._keys.closed, str(time.time()).encode())

    def result(self, round_: int) -> tuple[str, ...] | None:
        with etcd_errors(self._settings, "reading a rendezvous result from"):
            value, _ = self._client.get(self._keys.result(round_))
        return parse_result(value)

    def join(self, round_: int, record: bytes, lease: Any, leaving: int | None,
             was_participant: bool, also: dict[str, bytes] | None = None) -> int | None:
        """Joins ``round_`` (leaving round ``leaving``; ``also`` are more keys to write on the
        lease, such as the member record); returns the size of round ``round_ - 1`` (None if
        it has no result)."""
        c, k = self._client, self._keys
        ops = [put_request(c, key, data, lease) for key, data in (also or {}).items()]
        if leaving is not None and leaving != round_:
            ops.append(delete_request(c, k.join(leaving, self._node_id)))
            if was_participant:
                ops.append(put_request(c, k.restart(leaving), self._node_id.encode()))
        ops.append(put_request(c, k.join(round_, self._node_id), record, lease))
        ops.append(range_request(c, k.result(round_ - 1)))
        with etcd_errors(self._settings, f"joining rendezvous round {round_} in"):
            _, responses = raw_txn(c, [], ops)
        previous = parse_result(_value(responses[-1]))
        return None if previous is None else len(previous)

    def leave(self, round_: int) -> None:
        with etcd_errors(self._settings, f"leaving rendezvous round {round_} in"):
            self._client.delete(self._keys.join(round_, self._node_id))

    def poll(self, round_: int, lease: Any, coordinating: bool) -> PollView:
        """One request: claim the coordinator key if free, read the round's state (and the
        counts, for the coordinator)."""
        c, k = self._client, self._keys
        reads = [
            range_request(c, k.result(round_)),
            range_request(c, k.last_round),
            range_request(c, k.closed, count_only=True),
            range_request(c, k.join(round_, self._node_id), count_only=True),
            range_request(c, k.restart(round_ - 1), count_only=True),
        ]
        counts = [
            range_request(c, k.joins(round_), prefix=True, count_only=True),
            range_request(c, k.joins(round_ - 1), prefix=True, count_only=True),
        ]
        claim = c.transactions.version(k.coordinator(round_)) == 0
        success = [put_request(c, k.coordinator(round_), self._node_id.encode(), lease),
                   *reads, *counts]
        failure = [range_request(c, k.coordinator(round_)), *reads,
                   *(counts if coordinating else [])]
        with etcd_errors(self._settings, f"polling rendezvous round {round_} in"):
            answer = txn_response(c, [claim], success, failure)
        claimed, responses = answer.succeeded, list(answer.responses)
        coordinator = self._node_id if claimed else (_value(responses[0]) or b"").decode()
        result, last, closed, mine, restart = responses[1:6]
        view = PollView(
            round=round_,
            result=parse_result(_value(result)),
            last_round=_int(_value(last), -1),
            job_closed=_count(closed) > 0,
            joined_present=_count(mine) > 0,
            coordinator=coordinator or None,
            previous_restarted=_count(restart) > 0,
            revision=int(answer.header.revision),
        )
        if len(responses) > 6:
            joined, previous_joined = responses[6:8]
            view = dataclasses.replace(view, joined=_count(joined),
                                       previous_remaining=_count(previous_joined))
        return view

    def close(self, round_: int, max_nodes: int) -> tuple[str, ...] | None:
        """Writes round ``round_``'s result from its join keys; None if it was already written
        (by a coordinator before this one) or the job is closed."""
        c, k = self._client, self._keys
        prefix = k.joins(round_)
        with etcd_errors(self._settings, f"closing rendezvous round {round_} in"):
            _, responses = raw_txn(c, [], [
                range_request(c, prefix, prefix=True, keys_only=True,
                              sort_order="ascend", sort_target="create"),
                range_request(c, k.result(round_ - 1)),
            ])
            joined = [kv.key.decode()[len(prefix):] for kv in responses[0].response_range.kvs]
            previous = parse_result(_value(responses[1])) or ()
            participants = select_participants(joined, previous, max_nodes)
            if not participants:
                return None
            record = json.dumps({"round": round_, "participants": list(participants),
                                 "closed_by": self._node_id, "at": time.time()}).encode()
            t = c.transactions
            written, _ = raw_txn(
                c, [t.version(k.result(round_)) == 0, t.version(k.closed) == 0],
                [put_request(c, k.result(round_), record),
                 put_request(c, k.last_round, str(round_).encode()),
                 *self._prune(round_ - PRUNE_BEHIND)])
        return participants if written else None

    def _prune(self, round_: int) -> list[Any]:
        """Deletes round ``round_``'s keys and its workers' store (every rank's addresses: at
        thousands of ranks, thousands of keys a round). By the time round ``round_ + 2``
        closes nobody reads them: the protocol looks one round back, and a node still
        waiting in ``round_`` finds ``round`` past it and moves on."""
        if round_ < 0:
            return []
        c, k = self._client, self._keys
        return [delete_request(c, k.round_keys(round_), prefix=True),
                delete_request(c, k.round_store_keys(round_), prefix=True)]

    def wait_for_change(self, round_: int, coordinating: bool, after: int,
                        timeout_s: float) -> None:
        """Waits up to ``timeout_s`` for what a waiting node acts on next, changed after
        revision ``after``: round ``round_``'s result, or (its coordinator) any key of the
        round before it (a participant coming back or its join key ending). One watch, so the
        news arrives at once instead of at the next poll."""
        k = self._keys
        key, prefix = (k.round_keys(round_ - 1), True) if coordinating else (k.result(round_),
                                                                             False)
        with etcd_errors(self._settings, f"waiting for rendezvous round {round_} in"):
            watch_once(self._client, key, after + 1, timeout_s, prefix=prefix)

    def join_records(self, round_: int) -> list[tuple[str, dict[str, Any], int]]:
        """The join keys still in round ``round_``: (node id, join record, lease id) each."""
        c, k = self._client, self._keys
        prefix = k.joins(round_)
        with etcd_errors(self._settings, f"reading the joins of round {round_} from"):
            _, responses = raw_txn(c, [], [range_request(c, prefix, prefix=True)])
        found = []
        for kv in responses[0].response_range.kvs:
            try:
                record = json.loads(kv.value)
            except (ValueError, UnicodeDecodeError):
                record = {}
            found.append((kv.key.decode()[len(prefix):],
                          record if isinstance(record, dict) else {}, int(kv.lease)))
        return found

    def end_lease(self, lease_id: int) -> None:
        """Revokes another node's lease: everything on it (its join keys, its member record)
        vanishes now."""
        with etcd_errors(self._settings, "ending a node's membership in"):
            self._client.revoke_lease(lease_id)

    def running_view(self, round_: int) -> RunningView:
        c, k = self._client, self._keys
        with etcd_errors(self._settings, "checking for nodes waiting to rendezvous in"):
            _, responses = raw_txn(c, [], [
                range_request(c, k.last_round),
                range_request(c, k.restart(round_), count_only=True),
                range_request(c, k.joins(round_ + 1), prefix=True, count_only=True),
                range_request(c, k.closed, count_only=True),
                range_request(c, k.joins(round_), prefix=True, count_only=True),
            ])
        return RunningView(
            last_round=_int(_value(responses[0]), -1),
            restart_requested=_count(responses[1]) > 0,
            next_round_joined=_count(responses[2]),
            job_closed=_count(responses[3]) > 0,
            round_remaining=_count(responses[4]),
        )
