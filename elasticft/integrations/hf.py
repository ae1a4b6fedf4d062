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
directory only). The Trainer's own checkpoints (``save_steps``) are written and resumed as
without elasticft.

A step is snapshotted where the next one begins (``on_step_begin``, its batches fetched, before
any other callback), the last where it ends: after the step's logging, evaluation and save,
which may change the RNG, the callbacks' states and the Trainer's. With the model and optimizer
go the RNG states (torch's, CUDA's, Python's, numpy's where elasticft's snapshots hold it), the
states of the callbacks that export one (``ExportableState``, as the Trainer's checkpoints keep
them) and what the epoch's data loader iterator drew from at the epoch's start (torch's RNG and
the loader's and its samplers' generators). A resumed entry puts these back where they were
taken: the epoch's at its ``on_epoch_begin`` (the iterator it makes then draws the order and
seeds the uninterrupted epoch drew, and skips the batches done), the RNG and the callbacks'
states at the first step's ``on_step_begin``, after the resume's skipping drew from the one and
the Trainer called the others' ``on_train_begin`` and ``on_epoch_begin`` again. So a survivor
and a replacement redo a step with the dropout, the data order and the callbacks' states an
uninterrupted run had there.

Limits: DDP (one process per rank), one optimizer, no gradient scaler state (fp16 AMP)
carried; RNG drawn while fetching a batch (a collator's random masking) in the resumed epoch is
drawn from other states than in the uninterrupted run, as with the Trainer's own resume. FSDP
and DeepSpeed are refused in one line, untested: FSDP does not run on a CPU (Accelerate enables
it only for accelerator kinds; ``fsdp=True`` under gloo trains unsharded).
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import Any

import torch

from elasticft.ckpt.restoring.loaders import loader_generators
from elasticft.ckpt.restoring.state import rng_state, set_rng_state
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
    # First: it snapshots and restores before any other callback acts (see _Snapshots).
    trainer.callback_handler.callbacks.insert(0, entry.callback)
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
        self.resume_rng: dict[str, Any] | None = None
        """The RNG states of the restored step, put back at the first step's start."""
        self.resume_callbacks: dict[str, list[dict[str, Any]]] = {}
        """The restored step's :func:`_callback_states`, put back at the first step's start."""
        self.resume_epoch_rng: dict[str, torch.Tensor] | None = None
        """:func:`_epoch_rng` at the start of the restored step's epoch, put back at the
        resumed epoch's start."""

    def __call__(self) -> Any:
        trainer = self.trainer
        if self.recovery.entries > 1:  # as it was built: the failed entry's objects are dead
            trainer.accelerator.free_memory()
            trainer.model_wrapped, trainer.optimizer, trainer.lr_scheduler = self.built
            trainer._created_lr_scheduler = False
        self.resume_rng = self.resume_epoch_rng = None  # set by this entry's restore
        self.resume_callbacks = {}
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
            # and the RNG; the data loader this entry made drew its generator's seed before it
            self.resume_epoch_rng = self.callback.start_epoch_rng
            return
        extra = restored[1]["hf"]
        if trainer.lr_scheduler is not None and extra.get("scheduler") is not None:
            trainer.lr_scheduler.load_state_dict(json.loads(extra["scheduler"]))
        saved = json.loads(extra["trainer_state"])
        for name in ("epoch", "log_history", "total_flos", "num_input_tokens_seen",
                     "best_metric", "best_model_checkpoint", "best_global_step"):
            if name in saved and hasattr(trainer.state, name):
                setattr(trainer.state, name, saved[name])
        # The restore set the RNG to the step's; the Trainer's resume (its data loader skipping
        # the batches done) draws from it before the step starts, so it is put back then.
        self.resume_rng = rng_state()
        self.resume_callbacks = json.loads(extra.get("callbacks") or "{}")
        self.resume_epoch_rng = extra.get("epoch_rng")


def _torch_optimizer(optimizer: Any) -> Any:
    """The torch optimizer inside ``accelerate``'s wrapper."""
    inner = getattr(optimizer, "optimizer", None)
    return inner if inner is not None else optimizer


class _Snapshots(TrainerCallback):
    """Restores at the start of a resumed entry; snapshots each optimizer step at the start of
    the next one, or at its end for the last.

    It runs first among the Trainer's callbacks (:func:`train` puts it there), so the point a
    step is snapshotted at and the point a resumed entry puts its RNG and callbacks' states
    back at are the same: the next step's ``on_step_begin``, its batches fetched, before any
    other callback. Between a step's end and that point the Trainer logs, evaluates and saves
    (which may draw from the RNG and change the callbacks' states and its own) and, at an
    epoch's start, makes the data loader's iterator (which draws its seeds from torch's RNG).
    """

    def __init__(self, entry: _Entry) -> None:
        self.entry = entry
        self.unsaved: int | None = None
        """The step that ended in this entry and has no snapshot yet."""
        self.epoch_rng: dict[str, torch.Tensor] | None = None
        """The current epoch's :func:`_epoch_rng` (new tensors once an epoch)."""
        self.start_epoch_rng: dict[str, torch.Tensor] | None = None
        """The first epoch's :func:`_epoch_rng` in this process's first entry, for a survivor
        rolled back to the start (a replacement starting over draws the same by itself)."""

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        entry = self.entry
        self.unsaved = None
        if entry.resume_step is not None:
            entry.restore()
        elif entry.recovery.resuming:  # the first entry: its start is the roll-back target
            entry.recovery.keep_start(entry.trainer.model,
                                      _torch_optimizer(entry.trainer.optimizer))

    def on_epoch_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        entry, loader = self.entry, kwargs.get("train_dataloader")
        if entry.resume_epoch_rng is not None:
            # The resumed epoch's iterator draws its order and seeds as the epoch's start did,
            # then skips the batches done.
            _set_epoch_rng(entry.resume_epoch_rng, loader)
            entry.resume_epoch_rng = None
        self.epoch_rng = _epoch_rng(loader)
        if entry.recovery.entries == 1 and state.global_step == 0:
            self.start_epoch_rng = self.epoch_rng

    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        entry = self.entry
        if entry.resume_rng is not None:  # the first step of a resumed entry
            _load_callback_states(entry.trainer.callback_handler.callbacks,
                                  entry.resume_callbacks)
            set_rng_state(entry.resume_rng)
            entry.resume_rng, entry.resume_callbacks = None, {}
        elif self.unsaved is not None:
            self._snapshot(state, record=False)

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if state.global_step >= state.max_steps:  # no next step: the last is taken now
            self._snapshot(state, record=True)
        else:
            self.entry.recovery.step_done(state.global_step)
            self.unsaved = state.global_step

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.unsaved is not None:  # stopped before max_steps (early stopping): its last step
            self._snapshot(state, record=False)

    def _snapshot(self, state: Any, *, record: bool) -> None:
        trainer = self.entry.trainer
        scheduler = trainer.lr_scheduler
        extra: dict[str, Any] = {
            # JSON strings: a snapshot keeps leaves, not empty containers
            "trainer_state": json.dumps(_plain_state(state)),
            "scheduler": json.dumps(scheduler.state_dict()) if scheduler else None,
            "callbacks": json.dumps(_callback_states(trainer.callback_handler.callbacks)),
        }
        if self.epoch_rng is not None:
            extra["epoch_rng"] = self.epoch_rng
        self.entry.recovery.save(state.global_step, trainer.model,
                                 _torch_optimizer(trainer.optimizer), {"hf": extra},
                                 record=record)
        self.unsaved = None


def _epoch_rng(loader: Any) -> dict[str, torch.Tensor]:
    """What an epoch's iterator draws from, at the epoch's start: torch's RNG (the DataLoader's
    seed for its workers, a sampler's without a generator) and the generators of the training
    data loader and its samplers (``accelerate``'s sampler without ``use_seedable_sampler``
    keeps one that advances every epoch; its seedable one is seeded again every epoch)."""
    state = {"torch": torch.get_rng_state()}
    for n, generator in enumerate(loader_generators(loader)):
        state[f"generator {n}"] = generator.get_state()
    return state


def _set_epoch_rng(state: dict[str, torch.Tensor], loader: Any) -> None:
    torch.set_rng_state(state["torch"])
    for n, generator in enumerate(loader_generators(loader)):
        if f"generator {n}" in state:
            generator.set_state(state[f"generator {n}"])


def _callback_states(callbacks: list[Any]) -> dict[str, list[dict[str, Any]]]:
    """The states of the callbacks that export one (``ExportableState``), by class name in the
    handler's order, as the Trainer's checkpoints hold them."""
    states: dict[str, list[dict[str, Any]]] = {}
    for callback in callbacks:
        if isinstance(callback, ExportableState):
            states.setdefault(type(callback).__name__, []).append(callback.state())
    return states


def _load_callback_states(callbacks: list[Any],
                          states: dict[str, list[dict[str, Any]]]) -> None:
    """Sets each exporting callback's attributes to its state in ``states`` (the same
    objects, unlike the Trainer's own resume, which makes new ones)."""
    seen: dict[str, int] = {}
    for callback in callbacks:
        if not isinstance(callback, ExportableState):
            continue
        name = type(callback).__name__
        index = seen[name] = seen.get(name, -1) + 1
        if index < len(states.get(name, [])):
            for attribute, value in states[name][index].get("attributes", {}).items():
                setattr(callback, attribute, value)


def _plain_state(state: Any) -> dict[str, Any]:
    import dataclasses

    return {k: v for k, v in dataclasses.asdict(state).items() if k != "stateful_callbacks"}
