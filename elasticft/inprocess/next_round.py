"""The next rendezvous round of an in-process recovery, waited for while this node's workers
stay watched.

When a node is lost with its agent, the other agents take the next rendezvous round with their
workers still running (:mod:`elasticft.inprocess.across_nodes`): a standby, or the lost node back,
joins them there. That round can wait long: for a standby to arrive, for the rendezvous' last
call. Were it waited for on the agent's own thread, a survivor that died meanwhile would go
unseen until the round closed, and nothing would say that the round took longer than the
recovery allows.

:func:`join_watching` runs the round (torch's ``_rendezvous`` through the agent) on a thread of
its own, and meanwhile checks, once a monitor interval, which of this node's survivors died
(they are replaced in the round's generation, as a failed rank is) and whether the round has
overrun its limit (:func:`round_overrun`, pure: reported once, with its evidence, in the event
log). The round itself is not cut short: its own timeouts end it, and the recovery's join limit,
counted from the decision, then falls back to a restart.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable, Collection
from typing import Any


@dataclasses.dataclass(frozen=True)
class RoundOverrun:
    """A round that has waited past its limit."""

    reason: str
    evidence: dict[str, Any]
    """What the decision saw, for the event log."""


def round_overrun(*, started_at: float, now: float, limit_s: float) -> RoundOverrun | None:
    """Whether the round begun at ``started_at`` has overrun ``limit_s`` at ``now`` (pure;
    wall-clock times)."""
    waited = now - started_at
    if waited <= limit_s:
        return None
    return RoundOverrun(
        f"the next rendezvous round has waited {waited:.1f} s, past its limit of "
        f"{limit_s:.0f} s (the recovery's join limit)",
        {"started_at": started_at, "limit_s": limit_s, "seen_at": now,
         "over_s": round(waited - limit_s, 3)})


@dataclasses.dataclass
class Watch:
    """What :func:`join_watching` saw while the round waited."""

    died: dict[int, float] = dataclasses.field(default_factory=dict)
    """Local rank of a survivor → wall clock when its death was seen."""
    overrun: RoundOverrun | None = None


def join_watching(rendezvous: Callable[[], None], survivors: Collection[int],
                  dead: Callable[[], set[int]], *, limit_s: float, interval_s: float,
                  on_death: Callable[[int, float], None],
                  on_overrun: Callable[[RoundOverrun], None]) -> Watch:
    """Runs ``rendezvous`` on a thread and waits for it, checking every ``interval_s`` which
    of ``survivors`` (local ranks) are among ``dead()`` (``on_death``, once each) and whether
    the round overran ``limit_s`` (``on_overrun``, once); re-raises the round's error."""
    failed: list[BaseException] = []

    def run() -> None:
        try:
            rendezvous()
        except BaseException as e:  # handed to the waiting thread, which raises it
            failed.append(e)

    started_at = time.time()
    thread = threading.Thread(target=run, name="elasticft-next-round", daemon=True)
    thread.start()
    watch = Watch()
    waiting = True
    while waiting:  # once more after the round: a death in its last interval
        thread.join(interval_s)
        waiting, now = thread.is_alive(), time.time()
        for local_rank in sorted(set(survivors) & dead() - set(watch.died)):
            watch.died[local_rank] = now
            on_death(local_rank, now - started_at)
        if watch.overrun is None and (overrun := round_overrun(
                started_at=started_at, now=now, limit_s=limit_s)) is not None:
            watch.overrun = overrun
            on_overrun(overrun)
    if failed:
        raise failed[0]
    return watch
