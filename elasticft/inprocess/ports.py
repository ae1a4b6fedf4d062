"""What in-process recovery's agent half needs of the agent that holds it: the ports.

:class:`~elasticft.inprocess.agent_side.InProcessRecovery` is an object of the agent's, not a
part of it. It reads the agent's state and asks for the few things only the agent does through
:class:`AgentSide` (the attempt counter, a rendezvous, the agent's restart path), and it acts on
the node's worker processes through :class:`WorkerOps`: a replacement started in torch's process
context from the agent's warm pool, a spare handed a failed rank, a worker killed. The agent
implements both and passes them in, so this package imports nothing of ``elasticft.agent`` and
never edits torch's records of the workers: the agent's :meth:`WorkerOps.record_pids` does.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol, TypeVar

from elasticft.addon.api import GroupInfo

_R = TypeVar("_R")

EnvOf = Callable[[Mapping[str, str]], dict[str, str]]
"""A replacement's environment from the old worker's."""


class WorkerOps(Protocol):
    """The node's worker processes, as in-process recovery changes them while the others run."""

    def start_replacements(self, local_ranks: Sequence[int], env_of: EnvOf) -> dict[int, int]:
        """Starts a new process for each of ``local_ranks`` in torch's process context (from the
        warm interpreter when there is one), with ``env_of(the old worker's environment)``;
        returns their pids by local rank."""
        ...

    def hand_over(self, local_rank: int, env: Mapping[str, str], spare: Any) -> int:
        """Makes the running ``spare`` (a handler :meth:`start_spare` returned) the worker of
        ``local_rank`` in torch's process context, with ``env``; returns its pid."""
        ...

    def record_pids(self, pids: Mapping[int, int | None]) -> None:
        """Records each local rank's process in torch's worker group (its monitor compares a
        worker's id with the pid it polls)."""
        ...

    def kill(self, local_ranks: Sequence[int]) -> None:
        """Kills the workers of ``local_ranks`` (SIGKILL; reaped by whoever polls them)."""
        ...

    def kill_then(self, local_ranks: Sequence[int], timeout_s: float, reap_first: bool,
                  then: Callable[[], _R], reaped: Callable[[float], None] | None = None) -> _R:
        """Kills the workers of ``local_ranks`` and runs ``then``: after they are reaped when
        ``reap_first`` (a GPU's memory is freed only then), else at once while a thread reaps
        them; ``reaped`` is called with the wall clock once they are gone."""
        ...

    def warm_spare(self) -> bool | None:
        """Whether the warm interpreter for a spare is ready (None: no warm interpreter)."""
        ...

    def start_spare(self, env: dict[str, str], outputs: Mapping[str, str], *, warm: bool
                    ) -> Any:
        """Starts a spare process like local rank 0's worker, with ``env`` and its
        ``outputs`` (stream → log path), from the warm interpreter when ``warm``; returns its
        handler (``proc``: the process; ``warm``: whether it started warm)."""
        ...


@dataclasses.dataclass(frozen=True)
class AgentSide:
    """What in-process recovery needs of the agent that holds it: reads of its state and the
    few things only the agent does."""

    context: Callable[[], Any]
    """torch's process context of the workers (None before their first start)."""
    worker_group: Callable[[], Any]
    """torch's ``WorkerGroup``: the workers' ranks, the round's address and world (read only)."""
    workers: WorkerOps
    """The node's worker processes, changed through the agent."""
    attempt: Callable[[], int]
    """The agent's attempt number (the workers' ``ELASTICFT_ATTEMPT``)."""
    next_attempt: Callable[[], int]
    """Counts a new attempt and a restart (a recovery uses one of ``--max-restarts``);
    returns the new attempt's number."""
    round: Callable[[], int]
    """The rendezvous round the workers run in."""
    group_info: Callable[[], GroupInfo]
    """What the collaborators see of the workers now."""
    rendezvous: Callable[[], None]
    """Joins the next rendezvous round with the workers still running."""
    restart_in_round: Callable[[str], None]
    """The agent's restart path, in the round just joined: its ``restart`` event and
    ``before_restart`` hooks (the healthy workers' checkpoint), then the workers stopped and
    started again (``cause`` says why)."""
    workers_changed: Callable[[], None]
    """The workers' processes changed without a restart: the agent hooks torch's poll of the
    new ones and tells its collaborators (``on_workers_started``)."""
    round_env: Callable[[int], dict[str, str]]
    """The variables of a local rank's worker that a round sets (its ranks, the world, the
    round, the collaborators' such as the layout), as they are now."""
