"""In-process recovery for torchtitan: its trainer's ``train()`` entered again in the same
process after a peer failed, the survivors keeping their sharded model.

Turned on by one config key, torchtitan's own way of swapping a component: the override target
``elasticft.integrations.torchtitan.inprocess`` in ``override.imports``::

    elasticft-run --standalone --nproc-per-node 8 -m torchtitan.train \\
        --module llama3 --config llama3_8b \\
        --override.imports elasticft.integrations.torchtitan.inprocess

(or ``override=OverrideConfig(imports=[...])`` in a ``config_registry`` function). The
override replaces the trainer's checkpoint manager by :class:`InProcessCheckpointManager`,
torchtitan's own DCP manager with two additions:

* when the trainer builds it (in ``Trainer.__init__``, after the process group, the device
  meshes, the FSDP2 and tensor-parallel model, its optimizers and schedulers, and the data
  loader exist), it arms recovery: the trainer's ``train`` runs under
  :class:`~elasticft.integrations.fit.FitRecovery` with the model parts as the
  :class:`~elasticft.inprocess.worker.InProcess` modules kept through a regroup, so their
  device meshes' groups are made again and FSDP2 pointed at them
  (:mod:`elasticft.inprocess.meshes`);
* ``train()`` opens with the manager's ``load`` and closes each step with its ``save``: ``save``
  also snapshots the model part and its optimizer into elasticft's memory with torchtitan's
  position (step, tokens seen, the schedule's ``last_epoch``, the data loader's state), and
  ``load`` restores the newest step every rank holds into the live objects, in place, before
  torchtitan's own checkpoint is looked at. On a survivor's re-entry nothing is built again:
  the same trainer, model, optimizers and data loader go on from the restored step. CUDA
  graphs (torchtitan's ``training.disable_cuda_graphs`` off) are captured again on the new
  group's communicators at the re-entry's first step.

torchtitan's own checkpoints (``checkpoint.enable``) are written and loaded as without
elasticft; a relaunch (or a restart when recovery in process is refused) resumes from
elasticft's memory when every rank holds a step there, else from torchtitan's folder.

Checked when recovery arms, each one line
(:func:`~elasticft.integrations.torchtitan_checks.trainer_problems`,
:func:`~elasticft.integrations.fit.entry_problems`): one model part (no pipeline parallel),
one optimizer, a fixed ``debug.seed`` (else the trainer broadcasts one while it is built),
torchtitan's own checkpoint manager, a regroupable backend, no collective on the default group
before ``train()``. The mesh torchtitan flattens for its loss is made again with the others
(:mod:`elasticft.inprocess.meshes`).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Mapping
from typing import Any

from elasticft.extras import require
from elasticft.inprocess.cuda_graphs import drop_on_failure
from elasticft.inprocess.worker import InProcess
from elasticft.integrations.fit import EntryRuleBroken, FitRecovery
from elasticft.integrations.torchtitan_checks import (
    SUPPORTED_CHECKPOINT,
    TrainerFacts,
    decode_position,
    encode_position,
    trainer_problems,
)

TORCHTITAN = (("torchtitan", "torchtitan"),)

require(TORCHTITAN, "in-process recovery for torchtitan", "torchtitan",
        "it needs a torch with CUDA: docs/frameworks/torchtitan.md")

from torchtitan.components.checkpointer.base import BaseCheckpointManager  # noqa: E402
from torchtitan.components.checkpointer.dcp import CheckpointManager  # noqa: E402
from torchtitan.config.override import override  # noqa: E402

logger = logging.getLogger(__name__)


class InProcessCheckpointManager(CheckpointManager):
    """torchtitan's checkpoint manager that arms in-process recovery of the trainer's
    ``train()`` and keeps every step in elasticft's memory."""

    @dataclasses.dataclass(kw_only=True, slots=True)
    class Config(CheckpointManager.Config):
        """torchtitan's checkpoint settings, unchanged."""

    def __init__(self, config: Config, *, dataloader: Any, model_parts: list[Any],
                 optimizers: Any, lr_schedulers: Any, states: dict[str, Any], **rest: Any
                 ) -> None:
        super().__init__(config, dataloader=dataloader, model_parts=model_parts,
                         optimizers=optimizers, lr_schedulers=lr_schedulers, states=states,
                         **rest)
        self.elasticft = _Recovered(states["train_state"], model_parts, optimizers,
                                    lr_schedulers, dataloader)

    def load(self, step: int = -1) -> bool:
        """The newest step every rank holds in elasticft's memory, else torchtitan's own
        checkpoint. Collective: every rank calls it at the start of ``train()``."""
        return self.elasticft.restore() or super().load(step)

    def save(self, curr_step: int, last_step: bool = False) -> bool:
        saved = super().save(curr_step, last_step)
        self.elasticft.save(curr_step)
        return saved


@override(target=BaseCheckpointManager.Config,
          description="elasticft: in-process recovery of Trainer.train()")
def inprocess(config: BaseCheckpointManager.Config) -> InProcessCheckpointManager.Config:
    """The override ``override.imports`` names: the same settings, elasticft's manager. A
    checkpoint manager other than torchtitan's own stops here with one line."""
    manager = type(config).__qualname__.removesuffix(".Config")
    if manager != SUPPORTED_CHECKPOINT:
        raise EntryRuleBroken(trainer_problems(TrainerFacts(1, 1, 0, manager))[0])
    return InProcessCheckpointManager.Config(**{
        field.name: getattr(config, field.name)
        for field in dataclasses.fields(CheckpointManager.Config)})


class _Recovered:
    """The trainer's pieces the recovery snapshots and restores, and its ``train`` wrapped."""

    def __init__(self, trainer: Any, model_parts: list[Any], optimizers: Any,
                 lr_schedulers: Any, dataloader: Any) -> None:
        self.trainer = trainer
        self.model_parts = model_parts
        self.optimizers = optimizers
        self.lr_schedulers = lr_schedulers
        self.dataloader = dataloader
        self.recovery = FitRecovery("torchtitan", InProcess(modules=model_parts))
        trainer_train = trainer.train  # the class's method, bound
        self.problems = trainer_problems(TrainerFacts(
            model_parts=len(model_parts), optimizers=len(getattr(optimizers, "optimizers", [])),
            seed=trainer.config.debug.seed))
        """Why this trainer cannot be recovered in process; then nothing is snapshotted."""
        self._start: dict[str, str | None] | None = None
        """The position at the first entry that restored nothing, for an entry that rolls
        back to the start."""

        def entry() -> Any:
            if self.recovery.entries > 1:
                self._capture_graphs_again()
            return trainer_train()

        def train() -> Any:
            if self.problems and self.recovery.inprocess.settings.directory is not None:
                raise EntryRuleBroken(self.problems[0])
            undrop = self._drop_graphs_on_failure()
            try:
                return self.recovery.run(entry)
            finally:
                undrop()

        trainer.train = train  # main() calls trainer.train(): entered again after a regroup

    def _drop_graphs_on_failure(self) -> Callable[[], None]:
        """torchtitan's CUDA graphs are dropped as soon as a training call failed, before the
        survivor waits for its groups' abort, which may wait for them
        (:mod:`elasticft.inprocess.cuda_graphs`); returns what unregisters that."""
        if self.trainer.config.training.disable_cuda_graphs:
            return lambda: None
        from torchtitan.distributed.cudagraph import cudagraph_teardown

        return drop_on_failure(cudagraph_teardown, "torchtitan's cudagraph_teardown")

    def _capture_graphs_again(self) -> None:
        """CUDA graphs captured before the regroup replayed the old group's communicators
        (dropped when the call failed): the step is wrapped again, so the first step of this
        entry captures them on the new group (torchtitan's own wrapper; eager on a CPU)."""
        trainer = self.trainer
        if trainer.config.training.disable_cuda_graphs:
            return
        from torchtitan.distributed.cudagraph import cudagraph_teardown, wrap_with_cuda_graph

        cudagraph_teardown()  # again: the drop at the failure may have raised (it is logged)
        trainer.fwd_bwd_fn = wrap_with_cuda_graph(trainer._forward_backward_body)

    def save(self, step: int) -> None:
        if self.problems:
            return
        self.recovery.save(step, self.model_parts[0], self.optimizers.optimizers[0],
                           {"torchtitan": self._position()})

    def restore(self) -> bool:
        if self.problems or not self.recovery.resuming:
            return False
        restored = self.recovery.restore(self.model_parts[0], self.optimizers.optimizers[0])
        if restored is None:  # nothing saved yet, or the start put back: so is the position
            if self._start is None:
                self._start = self._position()
            else:
                self._load_position(self._start)
            return False  # torchtitan's own checkpoint, if it has one, loads over the start
        self._load_position(restored[1]["torchtitan"])
        logger.warning("torchtitan resumes at step %d from elasticft's memory", restored[0])
        return True

    def _position(self) -> dict[str, str | None]:
        """The trainer's step, the schedulers' and the data loader's states, as extras."""
        return encode_position(self.trainer.state_dict(), self.lr_schedulers.state_dict(),
                               self.dataloader.state_dict() if self.dataloader else None)

    def _load_position(self, position: Mapping[str, Any]) -> None:
        train_state, schedulers, dataloader = decode_position(position)
        self.trainer.load_state_dict(train_state)
        self.lr_schedulers.load_state_dict(schedulers)
        if dataloader is not None and self.dataloader is not None:
            self.dataloader.load_state_dict(dataloader)
