"""In-process recovery for the Hugging Face ``Trainer``: ``train(trainer)`` in place of
``trainer.train()``, entered again in the same process after a peer failed.

The ``Trainer`` makes the process group when it is built (its ``TrainingArguments`` set up
``accelerate``'s state, from the launcher's variables): the group exists before
:func:`train` arms recovery, and after a regroup the default group is the survivor's new one,
which ``accelerate`` uses through ``torch.distributed`` without holding it.

On every entry the Trainer makes again its DDP wrapper (``accelerator.prepare`` around the
same model), its optimizer and its scheduler. Before an entry :func:`train` puts the trainer
back as it was built (``model_wrapped``, the optimizer and scheduler it was given, ``accelerate``'s
list of prepared objects freed), and when elasticft's memory holds a step on every rank (a
survivor's re-entry, a replacement, a restarted worker) it resumes the Trainer's own way:
``resume_from_checkpoint`` names a directory holding only the ``trainer_state.json`` of that
step, so the Trainer sets its global step and skips the batches already done, and a callback
copies the step's model and optimizer state into the objects just made (in place, at
``on_train_begin``) with the scheduler's state and the rest of the Trainer's state. The model's
files are never read for it (the Trainer's ``_load_from_checkpoint`` is skipped for that
directory only). A snapshot is taken at every ``on_step_end``; the Trainer's own checkpoints
(``save_steps``) are written and resumed as without elasticft.

Limits: DDP (one process per rank), one optimizer, no gradient scaler state (fp16 AMP)
carried. FSDP and DeepSpeed are refused in one line, untested: FSDP does not run on a CPU
(Accelerate enables it only for accelerator kinds; ``fsdp=True`` under gloo trains unsharded).
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import Any

from elasticft.extras import require
from elasticft.integrations.fit import EntryRuleBroken, FitRecovery

TRANSFORMERS = (("transformers", "transformers"), ("accelerate", "accelerate"))

require(TRANSFORMERS, "in-process recovery for the Hugging Face Trainer", "hf")

from transformers import TrainerCallback  # noqa: E402
from transformers.trainer_callback import ExportableState, TrainerState  # noqa: E402

TRAINER_PRIVATE = ("_load_from_checkpoint", "model_wrapped", "_created_lr_scheduler",
                   "_train_batch_size")
"""The Trainer's private pieces :func:`train` relies on, checked when it arms."""


def train(trainer: Any, recovery: FitRecovery | None = None, **train_kwargs: Any) -> Any:
    """``trainer.train(**train_kwargs)``, entered again after each in-process recovery."""
    missing = [name for name in TRAINER_PRIVATE if not hasattr(trainer, name)]
    if missing:
        import transformers

        raise EntryRuleBroken(f"transformers {transformers.__version__}'s Trainer lacks "
                              f"{', '.join(missing)}: in-process recovery needs transformers 5")
    if trainer.args.deepspeed or trainer.is_fsdp_enabled:
        raise EntryRuleBroken("in-process recovery of the Hugging Face Trainer supports DDP "
                              "only, not FSDP or DeepSpeed")
    recovery = recovery if recovery is not None else FitRecovery("the Hugging Face Trainer")
    entry = _Entry(trainer, recovery, train_kwargs)
    trainer.add_callback(entry.callback)
    try:
        return recovery.run(entry)
    finally:
        trainer.remove_callback(entry.callback)


class _Entry:
    """One call of ``trainer.train``, resumed from elasticft's memory when it holds a step."""

    def __init__(self, trainer: Any, recovery: FitRecovery, kwargs: dict[str, Any]) -> None:
        self.trainer = trainer
        self.recovery = recovery
        self.kwargs = kwargs
        self.built = (trainer.model_wrapped, trainer.optimizer, trainer.lr_scheduler)
        self.callback = _Snapshots(self)
        self.resume_step: int | None = None

    def __call__(self) -> Any:
        trainer = self.trainer
        if self.recovery.entries > 1:  # as it was built: the failed entry's objects are dead
            trainer.accelerator.free_memory()
            trainer.model_wrapped, trainer.optimizer, trainer.lr_scheduler = self.built
            trainer._created_lr_scheduler = False
        self.resume_step = self.recovery.newest_common_step() if self.recovery.resuming \
            else None
        if not self.resume_step:  # nothing in memory, or the start (step 0): a fresh start
            return trainer.train(**self.kwargs)
        with tempfile.TemporaryDirectory(prefix="elasticft-resume-") as directory:
            # What the Trainer reads to resume: the step, and the settings it compares.
            # The stateful callbacks listed as the Trainer lists them when it starts, so its
            # own checkpoints can save their states.
            stateful = [callback for callback in [*trainer.callback_handler.callbacks,
                                                  trainer.control]
                        if isinstance(callback, ExportableState)]
            state = TrainerState(global_step=self.resume_step, stateful_callbacks=stateful,
                                 train_batch_size=trainer._train_batch_size)
            state.compute_steps(trainer.args, max(trainer.args.max_steps, 1))
            state.save_to_json(str(Path(directory) / "trainer_state.json"))
            original = trainer._load_from_checkpoint

            def load_model(checkpoint: str, *args: Any, **kwargs: Any) -> None:
                if checkpoint != directory:  # restored in place at on_train_begin instead
                    original(checkpoint, *args, **kwargs)

            trainer._load_from_checkpoint = load_model
            try:
                return trainer.train(**{**self.kwargs, "resume_from_checkpoint": directory})
            finally:
                del trainer._load_from_checkpoint

    def restore(self) -> None:
        """The step agreed on before the entry, into the model and the optimizer the Trainer
        just made, with its scheduler and state."""
        trainer = self.trainer
        restored = self.recovery.restore(trainer.model, _torch_optimizer(trainer.optimizer))
        if (restored[0] if restored else 0) != self.resume_step:
            raise EntryRuleBroken(f"elasticft's memory restored step "
                                  f"{restored[0] if restored else None}, not the step "
                                  f"{self.resume_step} the Trainer resumed at")
        if restored is None:  # the start, put back into the model (the entry made the rest)
            return
        extra = restored[1]["hf"]
        if trainer.lr_scheduler is not None and extra.get("scheduler") is not None:
            trainer.lr_scheduler.load_state_dict(json.loads(extra["scheduler"]))
        saved = json.loads(extra["trainer_state"])
        for name in ("epoch", "log_history", "total_flos", "num_input_tokens_seen",
                     "best_metric", "best_model_checkpoint", "best_global_step"):
            if name in saved and hasattr(trainer.state, name):
                setattr(trainer.state, name, saved[name])


def _torch_optimizer(optimizer: Any) -> Any:
    """The torch optimizer inside ``accelerate``'s wrapper."""
    inner = getattr(optimizer, "optimizer", None)
    return inner if inner is not None else optimizer


class _Snapshots(TrainerCallback):
    """Restores at the start of a resumed entry; snapshots after every optimizer step."""

    def __init__(self, entry: _Entry) -> None:
        self.entry = entry

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        entry = self.entry
        if entry.resume_step is not None:
            entry.restore()
        elif entry.recovery.resuming:  # the first entry: its start is the roll-back target
            entry.recovery.keep_start(entry.trainer.model,
                                      _torch_optimizer(entry.trainer.optimizer))

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        trainer = self.entry.trainer
        scheduler = trainer.lr_scheduler
        self.entry.recovery.save(state.global_step, trainer.model,
                                 _torch_optimizer(trainer.optimizer), {"hf": {
                                     "trainer_state": json.dumps(_plain_state(state)),
                                     # JSON strings: a snapshot keeps leaves, not empty containers
                                     "scheduler": json.dumps(scheduler.state_dict())
                                     if scheduler else None,
                                 }})


def _plain_state(state: Any) -> dict[str, Any]:
    import dataclasses

    return {k: v for k, v in dataclasses.asdict(state).items() if k != "stateful_callbacks"}
