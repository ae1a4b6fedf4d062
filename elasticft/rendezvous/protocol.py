"""The rendezvous round protocol's decisions: pure functions over what one poll of etcd saw.

A *round* ``T`` of the ``etcd-v3`` rendezvous is the set of nodes that train together until the
next round. Each node joins ``T`` by writing its own key (``rdzv/r/<T>/join/<node>``, on its
etcd lease); one of them, the *coordinator* (whoever first created ``rdzv/r/<T>/coordinator``,
also on its lease, so a dead coordinator is replaced by the next node that polls), decides when
the round closes and writes its participant list once (``rdzv/r/<T>/result``). Every other node
polls a few small keys about once a second, so a round costs O(1) etcd requests per node
instead of torch's O(N) compare-and-set retries of one shared blob.

This module holds the decisions, with no I/O (tests/rendezvous/test_protocol.py is their table):

* :func:`decide` — what a waiting node does after a poll: wait, close the round (coordinator:
  at ``max`` nodes; once every live participant of the previous round is in and the round
  does not grow, at once; else after the last call),
  take its rank, move to the next round (a standby of a full job, or a late joiner), join again
  (its join key vanished with an expired lease), or stop (timeout, job closed).
* :func:`round_may_close` — the gate: round ``T`` may close only once round ``T-1`` is over
  for the job (a participant came back or was lost, or ``T-1`` had room), so standbys waiting
  for a full job never start a round of their own; :func:`waits_as_standby` says when a wait
  has no join timeout.
* :func:`select_participants` — who the closer admits: the previous round's participants
  first, in their old rank order (ranks stay stable), then the others first come, first served
  (ranked by node id), at most ``max_nodes``.
* :func:`restart_needed` — the running participants' question (``num_nodes_waiting``).
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Sequence

from elasticft.decision import Decision


class MoveKind(enum.Enum):
    """What a waiting node does next, after one poll of the round (the kind of a :class:`Move`)."""

    WAIT = "wait"
    CLOSE = "close"
    """This node coordinates the round and closes it now."""
    PARTICIPANT = "participant"
    STANDBY = "standby"
    """The round closed full without this node: wait in the next round as a warm standby."""
    LATE = "late"
    """The round closed (with room) without this node: join the next round."""
    REJOIN = "rejoin"
    """This node's join key is gone (its lease expired during an etcd outage): write it again."""
    TIMEOUT = "timeout"
    CLOSED = "closed"
    """The job is closed: no more rounds."""


@dataclasses.dataclass(frozen=True)
class Move(Decision[MoveKind]):
    """A waiting node's next move after one poll, and how soon it polls again."""

    fast: bool = False
    """Poll again soon (the coordinator of a round that may close); else at the slow pace."""
    announce: bool = False
    """A wait worth a log line (once a round): one that outlasts the last call."""


@dataclasses.dataclass(frozen=True)
class RoundPoll:
    """One node's view of round ``round`` from a single poll."""

    round: int
    node_id: str
    min_nodes: int
    max_nodes: int
    job_closed: bool = False
    result: tuple[str, ...] | None = None
    last_round: int = -1
    """The last completed round (``rdzv/round``; -1 before the first)."""
    joined_present: bool = True
    """Whether this node's join key is still there."""
    coordinator: str | None = None
    joined: int = 0
    """Join keys of this round (read by the coordinator only)."""
    may_close: bool = True
    """:func:`round_may_close` for this round."""
    previous_remaining: int | None = None
    """(coordinator) Live participants of the previous round that have not joined this one
    yet. They are on their way (every live participant is told to come back once a new round
    forms), so a round does not close without them: a full round not before the last call,
    so that a standby does not take the place of a healthy node; any round not before
    ``rejoin_s`` after the last call, so that two nodes do not take turns closing alone."""
    previous_size: int | None = None
    """Participants of the previous round (None: no such round, or its result is gone)."""
    rejoin_s: float = 60.0
    """How long after the last call a round still waits for ``previous_remaining`` (an agent
    whose lease is alive but that never comes back, a hung one, is left behind then)."""
    quorum_for_s: float | None = None
    """How long the coordinator has seen at least ``min_nodes`` joined (None: not now)."""
    last_call_s: float = 30.0
    waited_s: float = 0.0
    join_timeout_s: float = 600.0
    standby: bool = False
    """This node waits here as a standby of a full job (no join timeout, as in torch)."""


def decide(poll: RoundPoll) -> Move:
    """What the node does next; see :class:`MoveKind`."""
    if poll.result is not None:
        if poll.node_id in poll.result:
            return Move(MoveKind.PARTICIPANT, f"rank {poll.result.index(poll.node_id)} of "
                        f"{len(poll.result)} in round {poll.round}")
        if len(poll.result) >= poll.max_nodes:
            return Move(MoveKind.STANDBY, f"round {poll.round} closed full "
                        f"({len(poll.result)} nodes) without this node")
        return Move(MoveKind.LATE, f"round {poll.round} closed with {len(poll.result)} "
                    "nodes before this node joined")
    if poll.job_closed:
        return Move(MoveKind.CLOSED, "the job is closed")
    if poll.last_round >= poll.round:
        # The round's result was already pruned, or this node missed it altogether.
        return Move(MoveKind.LATE, f"round {poll.last_round} already closed")
    if not poll.joined_present:
        return Move(MoveKind.REJOIN, "this node's join record expired with its lease")
    if not poll.standby and poll.waited_s >= poll.join_timeout_s:
        return Move(MoveKind.TIMEOUT, f"round {poll.round} did not close within "
                    f"{poll.join_timeout_s:.0f} s ({poll.joined} node(s) joined, "
                    f"min {poll.min_nodes})")
    if poll.coordinator != poll.node_id:
        return Move(MoveKind.WAIT, f"waiting for {poll.coordinator or 'a coordinator'}")
    if not poll.may_close:
        return Move(MoveKind.WAIT, "the previous round is still running, full")
    if poll.joined >= poll.max_nodes and not poll.previous_remaining:
        return Move(MoveKind.CLOSE, f"{poll.joined} nodes joined (max {poll.max_nodes})")
    if (poll.quorum_for_s is not None and poll.previous_size is not None
            and poll.previous_remaining == 0 and poll.joined <= poll.previous_size):
        # Nobody may still come: every live participant of the previous round is in (the
        # others' leases ended), and the round does not grow, so it is no scale-up that the
        # last call would let more new nodes join. A shrink closes here, at once.
        return Move(MoveKind.CLOSE, f"{poll.joined} nodes joined: every live participant "
                    f"of round {poll.round - 1} ({poll.previous_size} nodes) is in")
    if poll.quorum_for_s is not None and poll.quorum_for_s >= poll.last_call_s:
        if poll.previous_remaining and poll.quorum_for_s < poll.last_call_s + poll.rejoin_s:
            # A live participant of the previous round was told to come back and is stopping
            # its workers, which can outlast a short last call. Closing without it would make
            # it a late joiner that stops this round in turn: two nodes taking turns to close
            # a round alone, for ever.
            return Move(MoveKind.WAIT, f"{poll.previous_remaining} live participant(s) of "
                        f"round {poll.round - 1} on their way (up to {poll.rejoin_s:g} s "
                        "after the last call)", fast=True, announce=True)
        return Move(MoveKind.CLOSE, f"{poll.joined} nodes joined (min {poll.min_nodes}) "
                    f"and the last call of {poll.last_call_s:g} s is over")
    return Move(MoveKind.WAIT, f"{poll.joined} of {poll.min_nodes}..{poll.max_nodes} joined",
                fast=True)


def round_may_close(
    round_: int,
    previous_size: int | None,
    previous_restarted: bool,
    previous_remaining: int | None,
    max_nodes: int,
) -> bool:
    """Whether round ``round_`` may close (the gate; only the coordinator asks).

    ``previous_size``: the participants of round ``round_ - 1`` (None when there is no such
    round or its result is gone); ``previous_restarted``: one of them came back to rendezvous
    (its ``restart`` key); ``previous_remaining``: join keys still in that round (a lost
    participant's expired with its lease; None: not read).
    """
    if round_ <= 0 or previous_size is None or previous_size < max_nodes:
        return True
    if previous_restarted:
        return True
    return previous_remaining is not None and previous_remaining < previous_size


def waits_as_standby(previous_size: int | None, previous_restarted: bool, max_nodes: int) -> bool:
    """Whether a node waiting for the round after one of ``previous_size`` nodes is a warm
    standby: that round is full and still running, so the wait has no join timeout (as in
    torch's redundancy list)."""
    return previous_size is not None and previous_size >= max_nodes and not previous_restarted


def select_participants(
    joined: Sequence[str], previous: Sequence[str], max_nodes: int
) -> tuple[str, ...]:
    """The closed round's participants in rank order (``joined`` is in join order).

    The previous round's participants come first, in their old rank order, so that ranks stay
    where they were; places left up to ``max_nodes`` go to the others first come, first
    served, ranked by node id (deterministic, like torch's ordering by address and pid).
    """
    here = set(joined)
    kept = [node for node in previous if node in here]
    kept_set = set(kept)
    new = [node for node in joined if node not in kept_set][:max(0, max_nodes - len(kept))]
    return tuple(kept[:max_nodes] + sorted(new))


def restart_needed(
    round_: int,
    round_size: int,
    last_round: int,
    restart_requested: bool,
    next_round_joined: int,
    max_nodes: int,
    round_remaining: int | None = None,
) -> int:
    """``num_nodes_waiting`` for a participant of round ``round_`` (``round_size`` nodes):
    above 0 when the running group should stop and rendezvous again.

    Yes when a participant of the round came back to rendezvous (``restart_requested``), when a
    later round closed without this node, or when nodes wait for the next round and there is
    room for them: the round had fewer than ``max_nodes``, or one of its participants was lost
    (``round_remaining``, the round's live join keys, is below its size: a standby then takes
    its place, as torch's dynamic rendezvous does). A standby waiting for a full job whose
    nodes are all alive is not a reason.
    """
    if last_round > round_ or restart_requested:
        return max(1, next_round_joined)
    lost = round_remaining is not None and round_remaining < round_size
    if round_size < max_nodes or lost:
        return next_round_joined
    return 0
