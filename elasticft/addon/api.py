"""The node agent's extension points: collaborators and the facts passed to them.

The agent (:mod:`elasticft.agent.agent`) runs torch's worker lifecycle and delegates everything
else to collaborators passed into its constructor: the checkpoint service, the diagnostics
monitor, the Slurm handler. Each overrides only the hooks it needs; every hook has a no-op
default, and a collaborator that raises is logged and never takes the agent down.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Protocol, TypeVar, cast

from elasticft.addon.classify import FailureClass, FailureRecord
from elasticft.addon.policy import Action, KnownFacts
from elasticft.events import EventLog

if TYPE_CHECKING:  # torch's launcher is loaded only once elasticft-run has checked its version
    from elasticft.config import ElasticftConfig
    from elasticft.torch_compat import LaunchConfig


@dataclasses.dataclass(frozen=True)
class WorkerInfo:
    local_rank: int
    global_rank: int
    world_size: int
    pid: int | None = None


@dataclasses.dataclass(frozen=True)
class GroupInfo:
    """This node's worker group as of the latest rendezvous round."""

    run_id: str
    node_id: str
    run_dir: Path
    round: int
    """Rendezvous round (job-global), unlike torch's per-agent restart count."""
    group_rank: int
    group_world_size: int
    restart_count: int
    workers: tuple[WorkerInfo, ...]
    master_addr: str = ""
    master_port: int = 0
    in_process: bool = False
    """Every worker recovers in process (:mod:`elasticft.inprocess.worker`): the survivors
    keep their processes and restore their own newest snapshot after a failure."""


@dataclasses.dataclass(frozen=True)
class Detection:
    """A problem found while every worker process is still alive (a hang, a sick node...)."""

    failure_class: FailureClass
    ranks: tuple[int, ...]
    detector: str
    message: str
    node_suspect: bool = False
    evidence: Mapping[str, Any] = dataclasses.field(default_factory=dict)

    def as_failures(self, group: GroupInfo) -> tuple[FailureRecord, ...]:
        by_rank = {w.global_rank: w for w in group.workers}
        return tuple(
            FailureRecord(
                rank=rank,
                local_rank=by_rank[rank].local_rank if rank in by_rank else -1,
                pid=(by_rank[rank].pid or -1) if rank in by_rank else -1,
                exitcode=0,
                failure_class=self.failure_class,
                message=self.message,
                source=self.detector,
            )
            for rank in (self.ranks or tuple(by_rank))
        )


class StopRun(Exception):
    """Raised by a collaborator's hook to end the run for a reason that is not a failure.

    The Slurm handler raises it after a time-limit checkpoint and requeue. The agent lets it
    through (other exceptions of collaborators are logged and swallowed); the launcher stops the
    workers and reports ``state``, ``reason`` and ``exit_code``.
    """

    def __init__(self, state: str, reason: str, exit_code: int = 0) -> None:
        super().__init__(reason)
        self.state = state
        self.reason = reason
        self.exit_code = exit_code


def run_ending_errors() -> tuple[type[Exception], ...]:
    """What a hook's error handling must let through (``except run_ending_errors(): raise``): a
    deliberate end of the run, and the launcher's own SIGTERM/SIGINT, which torch's handler raises
    as ``SignalException`` in whatever code the agent's main thread runs at that moment (often a
    hook). Swallowed, it would leave the launcher and its workers running after ``kill`` or
    ``scancel``. torch is imported here, not with this module: ``elasticft-run`` checks the torch
    version before anything of torch's launcher is loaded, and a hook only runs inside the agent.
    """
    from elasticft.torch_compat import SignalException

    return (StopRun, SignalException)


class AgentCollaborator:
    """A part of the agent; override the hooks you need."""

    def worker_env(self, group: GroupInfo, worker: WorkerInfo) -> Mapping[str, str]:
        """Extra environment for one worker (added to torch's, never replacing it)."""
        return {}

    def python_path(self) -> Sequence[Path]:
        """Directories every worker needs first on ``PYTHONPATH`` (a bootstrap whose
        ``sitecustomize`` runs at start-up). The agent composes the variable once from every
        collaborator's (:func:`prepend_paths`), the user's entries after them."""
        return ()

    def on_rendezvous(self, group: GroupInfo, store: Any) -> None:
        """A rendezvous round completed; ``store`` is that round's (prefixed) store, shared by
        every agent of the round (e.g. for the leader to publish job-wide decisions)."""

    def on_workers_started(self, group: GroupInfo) -> None:
        """Workers of a new attempt are running; ``group.workers`` carry their pids."""

    def check(self, group: GroupInfo) -> Detection | None:
        """Called every monitor interval while all workers are alive."""
        return None

    def before_survivors_stopped(self, group: GroupInfo, failed_local_ranks: tuple[int, ...]
                                 ) -> None:
        """A worker process exited with an error and torch is about to stop the others; runs
        while they still live (briefly: the agent waits for it)."""

    def on_failure(self, group: GroupInfo, failures: tuple[FailureRecord, ...]) -> None:
        """A failure was found; runs before the agent's restart or stop (e.g. to flush state).
        A worker process that failed has already made torch stop the others."""

    def failure_facts(self, group: GroupInfo, failures: tuple[FailureRecord, ...]
                      ) -> KnownFacts:
        """Facts this collaborator knows about a failure, as ``FailureFacts`` field values
        (e.g. ``can_evict``, ``replicas_intact``); runs after ``on_failure``, before the policy."""
        return {}

    def on_decision(self, group: GroupInfo, action: Action) -> None:
        """The policy decided; runs before the action is carried out."""

    def before_restart(self, group: GroupInfo, cause: str, counted: bool) -> None:
        """The live worker group is about to be stopped for a restart; ``counted`` is False for
        a membership change (another node failed or joins), where no failure hook ran here."""

    def on_workers_stopped(self, group: GroupInfo) -> None:
        """This attempt's workers are gone (restart, stop or success)."""

    def on_workers_succeeded(self, group: GroupInfo) -> None:
        """Every worker finished; runs before the exit barrier, so work other nodes still need
        from this one (their final backups land here) is done while every node is alive."""

    def close(self) -> None:
        """The agent is exiting; release what this collaborator holds."""


def prepend_paths(entries: Sequence[str | Path], existing: str | None,
                  sep: str = os.pathsep) -> str:
    """A search path (``PYTHONPATH``, ``LD_PRELOAD``) with ``entries`` first, in their order,
    and ``existing``'s after them (pure). An entry ``existing`` holds already stays where it is:
    the user's order is never changed, and nothing is listed twice."""
    parts = [p for p in (existing or "").split(sep) if p]
    new = [e for e in dict.fromkeys(str(e) for e in entries) if e not in parts]
    return sep.join([*new, *parts])


# ----------------------------------------------------------------------------------------------
# Add-ons: how a subsystem joins the agent.


@dataclasses.dataclass(frozen=True)
class AddOnContext:
    """What every add-on is built from: elasticft's options, torch's launch config, the
    environment the launcher started in (read here, never inside a constructor), and the
    services the launcher made once for the whole agent.

    An add-on takes the agent's event log from here instead of opening the file itself: one
    open file per agent, whose events keep the order in which they happened."""

    options: ElasticftConfig
    launch: LaunchConfig
    env: Mapping[str, str]
    events: EventLog | None = None
    """The agent's event log, opened once by the launcher, which also closes it (None: an
    add-on built outside an agent)."""
    run_dir: Path | None = None
    """The run directory (by default the options', which the launcher has resolved)."""

    def __post_init__(self) -> None:
        if self.run_dir is None and self.options.agent.run_dir is not None:
            object.__setattr__(self, "run_dir", Path(self.options.agent.run_dir))


C = TypeVar("C", bound=AgentCollaborator, covariant=True)


class AddOn(Protocol[C]):
    """One subsystem's way into the agent (checkpoints, diagnostics, recovery, the layout plan,
    step records, Slurm).

    ``needs`` names the add-ons whose collaborators :meth:`build` receives, by their class (or
    by name, for one a subsystem may not import): they are built first, and one that is off
    arrives as None; :meth:`Built.of` gives each typed as its add-on builds it. ``runs_before``
    names the add-ons whose hooks must run after this one's. The launcher orders both from these
    declarations (:func:`elasticft.agent.addons.build_order`,
    :func:`~elasticft.agent.addons.hook_order`), so no order lives in comments. An add-on that
    subclasses this protocol needs none and runs before none unless it says so.
    """

    name: ClassVar[str]
    needs: ClassVar[tuple[str | type[AddOn[Any]], ...]] = ()
    runs_before: ClassVar[tuple[str, ...]] = ()

    def build(self, context: AddOnContext, built: Built) -> C | None:
        """The collaborator, or None when the options turn this add-on off."""
        ...


def add_on_name(add_on: str | type[AddOn[Any]]) -> str:
    """The name of an add-on named in ``needs``, by class or by name."""
    return add_on if isinstance(add_on, str) else add_on.name


T = TypeVar("T", bound=AgentCollaborator)


class Built(dict[str, AgentCollaborator | None]):
    """The collaborators of the add-ons one add-on needs, by add-on name."""

    def of(self, add_on: type[AddOn[T]]) -> T | None:
        """The collaborator ``add_on`` built (None: it is off), typed as that add-on builds it."""
        return cast("T | None", self.get(add_on.name))
