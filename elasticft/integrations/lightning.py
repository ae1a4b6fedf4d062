"""In-process recovery for Lightning: a DDP strategy and a model-parallel (FSDP2, tensor
parallel) strategy whose ``trainer.fit`` is entered again in the same process after a peer
failed.

``Trainer(strategy=InProcessDDPStrategy())`` or ``InProcessModelParallelStrategy(...)`` under
``elasticft-run``. Lightning calls a strategy's launcher with its fit function; where the
processes are made outside Lightning (the launcher's variables), these strategies' launcher
runs that function under
:class:`~elasticft.integrations.fit.FitRecovery`, so a survivor's ``trainer.fit`` is entered
again after its regroup, the exception never reaching Lightning's own handling.

The process group is made once, by the launcher, before recovery arms: the strategy's own
``setup_environment`` (Lightning's ``_init_dist_connection`` with the backend Lightning chose,
from the launcher's variables). Every later ``init_process_group`` of ``fit`` is skipped by
Lightning itself, since ``_init_dist_connection`` returns when ``torch.distributed`` is
initialized; after a regroup the default group is the survivor's new one, which Lightning
finds initialized the same way.

The model-parallel strategy makes its device mesh once too, in the same call, and keeps it: the
LightningModule, sharded by the user's ``configure_model`` in the first entry, is the
:class:`~elasticft.inprocess.worker.InProcess` module kept through a regroup, whose mesh's
groups are made again in place (:mod:`elasticft.inprocess.meshes`); ``configure_model``, called
on every entry, leaves the sharded module as it is (Lightning asks it to be idempotent).

On every entry Lightning makes again the DDP wrapper (around the same LightningModule), the
optimizer and its schedulers. Once they exist (the strategy's ``setup``) the newest
step every rank holds is copied into the module and that optimizer in place, and the
framework's position is loaded from the snapshot's extras: the fit loop's counters (through
``fit_loop.load_state_dict``, Lightning's own resume path, which also makes
``trainer.global_step`` right), the schedulers' states, and the data position, which Lightning
cannot resume for a plain ``DataLoader``: the training sampler skips the batches of the epoch
already done, once. A snapshot is taken at the start of every training batch (the previous
optimizer step is complete there); the step is recorded for the report when its optimizer step
ends. The state at the first batch (after Lightning's own load of a ``ckpt_path``) is the
start a failure before the first snapshot rolls back to.

Limits: one optimizer, automatic optimization, no gradient accumulation over several batches; a
training loader of a ``torch.utils.data`` sampler; callbacks' own states are kept in memory as
they are on the survivor (not rolled back). Lightning's ``FSDPStrategy`` (FSDP1) has no
in-process counterpart: FSDP2 goes through the model-parallel strategy.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from typing import Any

from elasticft.extras import require
from elasticft.integrations.fit import EntryRuleBroken, FitRecovery

LIGHTNING = (("lightning", "lightning"),)

require(LIGHTNING, "in-process recovery for Lightning", "lightning")

from lightning.pytorch.strategies import DDPStrategy, ModelParallelStrategy  # noqa: E402
from lightning.pytorch.strategies.launchers.launcher import _Launcher  # noqa: E402
from lightning.pytorch.trainer.states import TrainerFn  # noqa: E402

FIT_ARGS = ("model", "train_dataloaders", "val_dataloaders", "datamodule", "ckpt_path",
            "weights_only")
"""``Trainer._fit_impl``'s positional parameters, as ``Trainer.fit`` passes them."""


class _InProcessFit:
    """What the in-process strategies add to Lightning's: the newest step restored once the
    strategy's ``setup`` made the objects of this entry, a snapshot at every training batch,
    and the data position. Mixed into a Lightning strategy, before it."""

    _sampler: _SkipOnce | None = None

    def __init__(self, *args: Any, recovery: FitRecovery | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.recovery = recovery if recovery is not None else FitRecovery("Lightning")
        self._loop_at_start: str | None = None
        """The fit loop's state at the first entry that restored nothing (its counters at the
        start), for an entry that rolls back to the start."""

    def kept_modules(self, model: Any) -> tuple[Any, ...]:
        """The modules kept through a regroup with their device meshes (none for DDP)."""
        return ()

    def setup(self, trainer: Any) -> None:
        super().setup(trainer)  # the DDP wrapper, the optimizers, the schedulers
        if trainer.state.fn != TrainerFn.FITTING or not self.recovery.resuming:
            return
        if len(self.optimizers) != 1:
            raise EntryRuleBroken(f"in-process recovery of Lightning takes one optimizer, not "
                                  f"{len(self.optimizers)}")
        # The start is snapshotted at the first batch, after Lightning's own load (ckpt_path).
        restored = self.recovery.restore(self.lightning_module, self.optimizers[0],
                                         keep_start=False)
        if restored is None:  # nothing saved yet, or the start put back: so are the counters
            if self._loop_at_start is None:
                self._loop_at_start = json.dumps(trainer.fit_loop.state_dict())
            else:
                trainer.fit_loop.load_state_dict(json.loads(self._loop_at_start))
            return
        extra = restored[1]["lightning"]
        for config, state in zip(trainer.lr_scheduler_configs, extra["schedulers"], strict=True):
            config.scheduler.load_state_dict(json.loads(state))
        trainer.fit_loop.load_state_dict(json.loads(extra["fit_loop"]))
        # The batches of this epoch done by the restored step (its counters, now loaded).
        done = trainer.fit_loop.epoch_loop.batch_progress.current.completed
        self._skip_batches(trainer.train_dataloader, done)

    def process_dataloader(self, dataloader: object) -> object:
        dataloader = super().process_dataloader(dataloader)
        if self._sampler is not None and self._sampler.pending:
            self._skip_batches(dataloader, self._sampler.pending_batches)
        return dataloader

    def _skip_batches(self, dataloader: Any, batches: int) -> None:
        """The next iteration of the training loader starts ``batches`` batches in (made at
        the loader's first set-up when this entry has none yet)."""
        batch_sampler = getattr(dataloader, "batch_sampler", None)
        if batches <= 0:
            return
        if batch_sampler is None or not hasattr(batch_sampler, "sampler"):
            self._sampler = _SkipOnce(None, batches, 0)  # applied in process_dataloader
            return
        inner = batch_sampler.sampler
        if isinstance(inner, _SkipOnce):
            inner = inner.sampler
        self._sampler = _SkipOnce(inner, batches, batch_sampler.batch_size)
        batch_sampler.sampler = self._sampler

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        super().on_train_batch_start(batch, batch_idx)
        trainer = self.lightning_module.trainer
        step = trainer.global_step
        if step == 0:  # the start, once Lightning loaded its own checkpoint if it had one
            self.recovery.keep_start(self.lightning_module, self.optimizers[0])
            return
        if step == self.recovery.restored_step:
            return  # nothing new since the entry
        self.recovery.save(step, self.lightning_module, self.optimizers[0], {"lightning": {
            # JSON strings: a snapshot keeps leaves (not empty containers) under str keys.
            "fit_loop": json.dumps(trainer.fit_loop.state_dict()),
            "schedulers": [json.dumps(c.scheduler.state_dict())
                           for c in trainer.lr_scheduler_configs],
        }}, record=False)

    def optimizer_step(self, *args: Any, **kwargs: Any) -> Any:
        """Lightning's optimizer step, recorded for the report as it ends: its snapshot waits
        for the next batch, and a step a failure then rolls back still counts as done once."""
        done = super().optimizer_step(*args, **kwargs)
        # Lightning counts the step (trainer.global_step) once this returns.
        self.recovery.step_done(self.lightning_module.trainer.global_step + 1)
        return done


class InProcessDDPStrategy(_InProcessFit, DDPStrategy):
    """Lightning's DDP strategy, whose ``fit`` a peer failure costs a roll-back in process.

    Takes DDPStrategy's arguments; ``recovery`` is for tests and for checkpoint options
    (``FitRecovery("lightning", ckpt_dir=...)``).
    """

    strategy_name = "elasticft_ddp"

    def _configure_launcher(self) -> None:
        super()._configure_launcher()
        assert self.cluster_environment is not None and self._launcher is not None
        if self.cluster_environment.creates_processes_externally:  # by elasticft-run
            self._launcher = _InProcessLauncher(self, self._launcher)


class InProcessModelParallelStrategy(_InProcessFit, ModelParallelStrategy):
    """Lightning's model-parallel strategy (FSDP2's ``fully_shard`` and tensor parallel,
    applied in ``configure_model``), whose ``fit`` a peer failure costs a roll-back in process,
    the survivors keeping their sharded module.

    Takes ModelParallelStrategy's arguments and ``recovery``. The device mesh is made once,
    before recovery arms, and kept: after a regroup its groups are made again in place
    (:mod:`elasticft.inprocess.meshes`). ``configure_model`` runs on every entry, on the module
    it sharded before: it must leave an already sharded module as it is, as Lightning asks
    of it anyway.
    """

    strategy_name = "elasticft_model_parallel"

    def _configure_launcher(self) -> None:
        super()._configure_launcher()
        assert self.cluster_environment is not None
        if self.cluster_environment.creates_processes_externally:  # by elasticft-run
            self._launcher = _InProcessLauncher(self, None)

    def setup_environment(self) -> None:
        if self._device_mesh is None:
            super().setup_environment()
        else:  # a later entry: the kept mesh, not a new one with new groups
            self.lightning_module._device_mesh = self._device_mesh

    def kept_modules(self, model: Any) -> tuple[Any, ...]:
        return (model,)


class _SkipOnce:
    """A sampler that leaves out its first ``batches`` batches once, then is the sampler it
    wraps (``set_epoch`` passes through)."""

    def __init__(self, sampler: Any, batches: int, batch_size: int) -> None:
        self.sampler = sampler
        self.pending_batches = batches
        self.batch_size = batch_size

    @property
    def pending(self) -> bool:
        return self.pending_batches > 0

    def set_epoch(self, epoch: int) -> None:
        if hasattr(self.sampler, "set_epoch"):
            self.sampler.set_epoch(epoch)

    def __len__(self) -> int:
        return len(self.sampler)

    def __iter__(self) -> Iterator[Any]:
        skip, self.pending_batches = self.pending_batches * self.batch_size, 0
        for index, item in enumerate(self.sampler):
            if index >= skip:
                yield item


class _InProcessLauncher(_Launcher):
    """Lightning's launcher, whose function runs under recovery: the process group is made
    once, recovery arms, and the function is entered again after each regroup."""

    def __init__(self, strategy: InProcessDDPStrategy | InProcessModelParallelStrategy,
                 inner: _Launcher | None) -> None:
        self.strategy = strategy
        self.inner = inner
        """The strategy's own launcher; None where Lightning has none (the function is called)."""

    @property
    def is_interactive_compatible(self) -> bool:
        return self.inner.is_interactive_compatible if self.inner is not None else True

    def launch(self, function: Callable[..., Any], *args: Any, trainer: Any = None,
               **kwargs: Any) -> Any:
        if trainer is None or trainer.state.fn != TrainerFn.FITTING:  # validate, test, predict
            if self.inner is None:
                return function(*args, **kwargs)
            return self.inner.launch(function, *args, trainer=trainer, **kwargs)
        if self.inner is None:
            return self._recovered(function, *args, **kwargs)
        return self.inner.launch(self._recovered, function, *args, trainer=trainer, **kwargs)

    def _recovered(self, function: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        self.strategy.setup_environment()  # Lightning's own init_process_group, made once
        recovery = self.strategy.recovery
        # The sharded module is known only now; InProcess reads its modules when it arms.
        recovery.inprocess.modules = self.strategy.kept_modules(args[0] if args else None)

        def entry() -> Any:
            call = dict(zip(FIT_ARGS, args, strict=False))
            if recovery.entries > 1 or recovery.inprocess.generation > 0:
                call["ckpt_path"] = None  # elasticft's memory is newer than any file
            return function(**call, **kwargs)

        return recovery.run(entry)

    def kill(self, signum: Any) -> None:
        if self.inner is not None:
            self.inner.kill(signum)
