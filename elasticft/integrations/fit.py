"""A framework's own training entry point, entered again in the same process after a peer
failed: the mechanism the framework integrations share.

A framework (Lightning, Hugging Face Trainer) builds on every entry into its training
(``trainer.fit``, ``trainer.train``) what is bound to the process group and to the run's
position: its DDP wrapper, its optimizer and scheduler objects, its loops' counters and its
data position. The model objects and their tensors are built by the user before the entry and
outlive it. :class:`FitRecovery` runs the entry under
:class:`~elasticft.inprocess.worker.InProcess`, so a survivor of a peer failure calls the same
entry again after its regroup, and gives the framework's integration the two halves it needs:

* every optimizer step, :meth:`FitRecovery.save` snapshots the live model and the optimizer the
  framework made this time into elasticft's shared memory (the
  :class:`~elasticft.ckpt.Checkpointer`'s memory tier), with the framework's own training
  position as JSON extras, and writes the step record ``elasticft report`` counts;
* on every entry, once the framework has made its objects again, :meth:`FitRecovery.restore`
  copies the newest step every rank holds into them in place (a fresh optimizer is given its
  state first) and hands back the extras, which the integration loads into the framework's new
  loop, scheduler and data position objects.

The framework's own checkpoints are not touched: they are written and loaded as the framework
does without elasticft. Without ``elasticft-run`` the entry is called once. Only the first
training run of a process is recovered in process: a replacement runs the script from its
start, so it could not meet the survivors in a second ``fit``; a later run goes on from the live
state and a failure in it restarts the workers, which resume from the same memory.

What the script must not do is checked when recovery arms, before the first entry
(:func:`entry_problems`, pure, on :class:`EntryFacts`): a collective on the default group
before the entry (a replacement process runs the script from its start and must meet the
survivors at the entry's first collective), process groups made outside the entry (they are not
made again after a regroup; those of the kept sharded modules' device meshes are, and
:class:`~elasticft.inprocess.meshes.KeptModules` counts them), or a backend that cannot be
regrouped. Each problem is one line, raised as :class:`EntryRuleBroken`.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from elasticft.inprocess import InProcess
from elasticft.steps import StepRecorder

logger = logging.getLogger(__name__)

_T = TypeVar("_T")

REGROUPABLE_BACKENDS = ("gloo", "nccl", "cpu:gloo,cuda:nccl")
"""Backends a survivor regroups (:mod:`elasticft.inprocess.groups`)."""


class EntryRuleBroken(RuntimeError):
    """The script broke a rule of in-process recovery; the message is one line naming it."""

    reason = "inprocess_entry_rule"


@dataclasses.dataclass(frozen=True)
class EntryFacts:
    """What is true of this process when recovery arms, just before the first entry."""

    launched: bool
    """Running under ``elasticft-run`` (its in-process directory is in the environment)."""
    group_initialized: bool
    """The default process group exists."""
    backend: str | None = None
    """The default group's backend."""
    groups: int = 0
    """Process groups made so far in this process (``dist.get_pg_count()``), the default one
    included."""
    collectives: int | None = None
    """Collectives issued on the default group so far (its sequence number), None where the
    backend does not count them."""
    framework: str = "the framework"
    kept_meshes: bool = False
    """The groups made before the entry are those of the kept sharded modules' device meshes,
    made again after a regroup and counted by
    :class:`~elasticft.inprocess.meshes.KeptModules` when it arms, not here."""

    @classmethod
    def now(cls, launched: bool, framework: str, kept_meshes: bool = False) -> EntryFacts:
        if not (dist.is_available() and dist.is_initialized()):
            return cls(launched, False, framework=framework, kept_meshes=kept_meshes)
        return cls(launched, True, str(dist.get_backend()), dist.get_pg_count(),
                   _collectives_so_far(), framework, kept_meshes)


def _collectives_so_far() -> int | None:
    try:
        group = dist.distributed_c10d._get_default_group()
        return int(group._get_sequence_number_for_group())
    except (AttributeError, RuntimeError):
        return None


def entry_problems(facts: EntryFacts) -> list[str]:
    """What breaks in-process recovery of ``facts.framework``'s entry, one line each (pure)."""
    if not facts.launched:
        return []  # no recovery to arm: the entry is called once
    if not facts.group_initialized:
        return [f"in-process recovery of {facts.framework} needs the process group made before "
                "the training entry (the integration makes it; a script that disables that "
                "must call init_process_group first)"]
    problems = []
    if facts.backend is not None and facts.backend.lower() not in REGROUPABLE_BACKENDS:
        problems.append(f"the process group's backend {facts.backend!r} cannot be regrouped "
                        f"in process; use one of {', '.join(REGROUPABLE_BACKENDS)}")
    if facts.groups > 1 and not facts.kept_meshes:
        problems.append(f"{facts.groups - 1} process group(s) besides the default one exist "
                        f"before {facts.framework}'s entry; they are not made again after a "
                        "regroup: make them inside the training (e.g. in a setup hook)")
    if facts.collectives:
        problems.append(f"{facts.collectives} collective(s) ran on the default group before "
                        f"{facts.framework}'s entry; a replacement process would not meet the "
                        "survivors at the same collective: move them inside the training")
    return problems


class FitRecovery:
    """Runs a framework's entry point under :class:`InProcess`, snapshots each step into
    elasticft's memory and restores the newest one into whatever objects the entry made."""

    def __init__(self, framework: str, inprocess: InProcess | None = None,
                 **checkpoint_defaults: Any) -> None:
        self.framework = framework
        self.inprocess = inprocess if inprocess is not None else InProcess()
        self.checkpoint_defaults = checkpoint_defaults
        """Passed to :meth:`elasticft.ckpt.Checkpointer.from_env` (e.g. ``ckpt_dir``)."""
        self.entries = 0
        """How often the entry was called in the current :meth:`run`."""
        self._saved = False
        self._runs = 0
        self.restored_step: int | None = None
        """The step the latest entry restored, None when it started from the beginning."""
        self._checkpointer: Any = None
        self._capture: Any = None
        self._captured: tuple[int, int] | None = None
        self._steps = StepRecorder(None)

    @property
    def recoveries(self) -> int:
        return self.inprocess.recoveries

    def check(self) -> None:
        """:func:`entry_problems` of this process now; :class:`EntryRuleBroken` for the first."""
        problems = entry_problems(EntryFacts.now(self.inprocess.settings.directory is not None,
                                                 self.framework, bool(self.inprocess.modules)))
        if problems:
            raise EntryRuleBroken(problems[0])

    def run(self, entry: Callable[..., _T], *args: Any, **kwargs: Any) -> _T:
        """``entry(*args, **kwargs)``, called again after each in-process recovery."""
        self.entries = 0
        self._steps = StepRecorder.from_env()
        if self._runs:  # the replacement of a later run would start the script over
            logger.warning("%s: only the first training run of a process is recovered in "
                           "process; this one restarts on a failure", self.framework)
        else:
            self.check()
        self._runs += 1
        try:
            if self._runs > 1:
                return entry(*args, **kwargs)
            return self.inprocess.run(self._enter, entry, args, kwargs)
        finally:  # a later run (a second fit) opens them again
            self._steps.close()
            if self._checkpointer is not None:
                self._checkpointer.close()
            self._checkpointer, self._capture, self._captured = None, None, None

    def _enter(self, entry: Callable[..., _T], args: Any, kwargs: Any) -> _T:
        self.entries += 1
        self.restored_step = None
        return entry(*args, **kwargs)

    @property
    def resuming(self) -> bool:
        """Whether this entry resumes from elasticft's memory: an entry again after a
        recovery, or the first entry of a process that has not trained yet (a replacement, a
        restarted worker, a relaunch). A second training run of the same process (another
        ``fit``) goes on from its live state instead. The same on every rank."""
        return self.entries > 1 or not self._saved

    def checkpointer(self, optimizer: torch.optim.Optimizer | None = None) -> Any:
        """The checkpointer, made at the first need (the process group exists by then), with
        ``optimizer`` guarded by it."""
        from elasticft.ckpt import Checkpointer

        if self._checkpointer is None:
            self._checkpointer = Checkpointer.from_env(**self.checkpoint_defaults)
        if optimizer is not None:
            self._checkpointer.watch(optimizer)
        return self._checkpointer

    def newest_common_step(self) -> int | None:
        """The newest step every rank holds in memory, for a framework that must know it
        before it makes the objects it is restored into. Collective (one all-reduce on the
        default group): every rank calls it at the same point of the entry."""
        own = self.checkpointer().newest_step()
        if not (dist.is_available() and dist.is_initialized()):
            return own
        device = "cuda" if "nccl" in str(dist.get_backend()).lower() else "cpu"
        agreed = torch.tensor([-1 if own is None else own], dtype=torch.int64, device=device)
        dist.all_reduce(agreed, op=dist.ReduceOp.MIN)
        return None if int(agreed.item()) < 0 else int(agreed.item())

    def save(self, step: int, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
             extra: Mapping[str, Any], *, record: bool = True) -> None:
        """Snapshots ``model`` and ``optimizer`` after optimizer step ``step`` (the count of
        steps done) with the framework's position ``extra`` (JSON values), and records the
        step for the report (``record=False``: :meth:`step_done` recorded it when it ended)."""
        from elasticft.ckpt import StateCapture

        checkpointer = self.checkpointer(optimizer)
        if self._captured != (id(model), id(optimizer)):
            self._capture = StateCapture(model, optimizer)
            self._captured = (id(model), id(optimizer))
        checkpointer.save(step, self._capture(extra={**extra, "step": step}))
        self._saved = True
        if record:
            self._steps.record(step)

    def step_done(self, step: int) -> None:
        """Records a step for the report, when it ends (a framework that snapshots it later,
        or not at all: the last one)."""
        self._steps.record(step)

    def keep_start(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
        """Snapshots the state training starts from (:meth:`Checkpointer.save_start
        <elasticft.ckpt.Checkpointer.save_start>`), for a framework whose first entry has
        nothing to restore: a peer failing before the first snapshot then rolls the survivors
        back to it, and :meth:`restore` puts it back and returns None."""
        self.checkpointer(optimizer).save_start(model, optimizer)

    def restore(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, *,
                keep_start: bool = True) -> tuple[int, dict[str, Any]] | None:
        """Copies the newest step every rank holds into ``model`` and ``optimizer`` (the ones
        this entry made); returns (step, the framework's extras), None when there is none, or
        when it put back the start (:meth:`keep_start`; ``keep_start=False``: not snapshotted
        here). Collective: every rank calls it at the same point of the entry."""
        restored = self.checkpointer(optimizer).restore(model, optimizer, keep_start=keep_start)
        if restored is None:  # nothing saved yet, or the start put back
            return None
        self.restored_step = restored[0]
        logger.warning("%s entry %d resumes from step %d (source=%s)", self.framework,
                       self.entries, restored[0], self._checkpointer.last_source)
        return restored
