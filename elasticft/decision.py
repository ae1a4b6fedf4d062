"""A decision: the answer of a pure function of the facts, with the reason for it.

The house decides by pure functions: the recovery policy turns the facts of a failure into an
action (:mod:`elasticft.addon.policy`), the rendezvous protocol turns one poll of etcd into a
node's next move (:mod:`elasticft.rendezvous.protocol`), and liveness turns a probe of a missing
agent into whether it is dead (:mod:`elasticft.rendezvous.liveness`). None of them does I/O or
reads a clock, so each is tested with a table. Each answers with a :class:`Decision`: one of the
moves it can make (its own enum) and the reason, one sentence that travels with the answer into
the log and the event log. A decision that says more (an exit code, a pace) adds fields in a
subclass.
"""

from __future__ import annotations

import dataclasses
from typing import Generic, TypeVar

KindT = TypeVar("KindT")


@dataclasses.dataclass(frozen=True)
class Decision(Generic[KindT]):
    kind: KindT
    """The answer: one of the moves the deciding function can make."""
    reason: str
    """Why, in one sentence for a person reading the log or the event log."""
