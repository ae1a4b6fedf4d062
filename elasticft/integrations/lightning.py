"""In-process recovery for Lightning: a DDP strategy and a model-parallel (FSDP2, tensor
parallel) strategy whose ``trainer.fit`` is entered again in the same process after a peer
failed.

``Trainer(strategy=InProcessDDPStrategy())`` or ``InProcessModelParallelStrategy(...)`` under
``elasticft-run``. Lightning calls a strategy's launcher with its fit function; where the
processes are made outside Lightning (the launcher's variables), these strategies' launcher
runs that function under
:class:`~elasticft.integrations.fit.FitRecovery`, so a survivor's ``trainer.fit`` is entered
again after its regroup, the exception never reaching Lightning's own handling.

Lightning comes as two packages of the same code whose classes are not each other's: the
unified ``lightning`` (``lightning.pytorch``) and the standalone ``pytorch_lightning``. A
``Trainer`` takes only a strategy of its own package, so the strategies are made for each
package from one implementation (:func:`strategies`), and the names a script imports,
:class:`InProcessDDPStrategy` and :class:`InProcessModelParallelStrategy`, make the one of the
package the script imported (:func:`package_in_use`).

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
``trainer.global_step`` right), the schedulers' states, the callbacks' states, and the data
position, which Lightning cannot resume for a plain ``DataLoader``: the training sampler skips
the batches the epoch's iterator had yielded, once. That is the epoch's count of batches done
less the batches its iterator never yielded: a fit resumed mid-epoch from Lightning's own
checkpoint (``ckpt_path``) iterates a plain loader from its start while its counters go on
from the checkpoint's, so a step of that epoch redone must draw what the iterator drew then.

The callbacks' states are what Lightning puts in its checkpoints' ``"callbacks"`` entry (each
callback's ``state_dict()`` under its ``state_key``, put back with ``load_state_dict``), and
for ``ModelCheckpoint`` the few fields outside it on which its decision to write rests
(:data:`DECISION_FIELDS`). The survivor's callbacks are rolled back with the step and the
replacement's new ones are given the same states, so every rank decides alike whether to write
a checkpoint: a write is a sequence of collectives (the file's existence broadcast, barriers),
and a survivor that had written the step it redoes would otherwise skip what a new process
writes, each waiting in another collective.

A snapshot is taken at the start of every training batch (the previous optimizer step is
complete there) by a callback placed first, before any other callback's hook of that batch, so
a step redone runs every hook of it once more from the same states; the step is recorded for the
report when its optimizer step ends. The state at the first batch (after Lightning's own load
of a ``ckpt_path``) is the start a failure before the first snapshot rolls back to. The RNG
states the restore put back are put back again at the first batch: the training loader's new
iterator draws its seed from torch's RNG between the two.

With gradient accumulation the snapshot is taken at the first batch of each optimizer step. The
values a module logs for the epoch (``self.log(..., on_epoch=True)``) are in the snapshot too
(:func:`logged_results`): ``EarlyStopping`` and a monitoring ``ModelCheckpoint`` read them at the
epoch's end.

Limits: one optimizer, automatic optimization; a training loader of a ``torch.utils.data``
sampler. Lightning's ``FSDPStrategy`` (FSDP1) has no in-process counterpart: FSDP2 goes
through the model-parallel strategy.
"""

from __future__ import annotations

import base64
import functools
import importlib
import importlib.util
import io
import json
import sys
from collections.abc import Callable, Collection, Iterator
from typing import Any, NamedTuple

import torch

from elasticft.extras import MissingExtra
from elasticft.integrations.fit import EntryRuleBroken, FitRecovery

PACKAGES = ("lightning.pytorch", "pytorch_lightning")
"""The Lightning packages the strategies are made for, the documented one first."""

if all(importlib.util.find_spec(p.split(".")[0]) is None for p in PACKAGES):
    raise MissingExtra("in-process recovery for Lightning", "lightning", "lightning")

FIT_ARGS = ("model", "train_dataloaders", "val_dataloaders", "datamodule", "ckpt_path",
            "weights_only")
"""``Trainer._fit_impl``'s positional parameters, as ``Trainer.fit`` passes them."""

FITTING = "fit"
"""``TrainerFn.FITTING`` (a ``str`` enum) of either package."""

DECISION_FIELDS = ("_last_global_step_saved", "_last_checkpoint_saved",
                   "_defer_save_until_validation")
"""``ModelCheckpoint``'s fields outside its ``state_dict`` that its decision to write rests on
(Lightning 2.5-2.6): the step it last wrote (it skips a step it wrote), the file it last wrote
(``save_last`` writes at the end when there is none), a write put off until validation. Rolled
back with the step like its ``state_dict``; a callback without them has nothing more taken."""


def package_in_use(imported: Collection[str], installed: Callable[[str], bool]) -> str:
    """The Lightning package a script uses (pure): the one it imported, ``lightning.pytorch``
    where it imported both, else the first installed."""
    found = [p for p in PACKAGES if p in imported]
    if found:
        return found[0]
    return next((p for p in PACKAGES if installed(p.split(".")[0])), PACKAGES[0])


def _installed(top: str) -> bool:
    return importlib.util.find_spec(top) is not None


class _InProcessFit:
    """What the in-process strategies add to Lightning's: the newest step restored once the
    strategy's ``setup`` made the objects of this entry, a snapshot at every training batch,
    and the data position. Mixed into a Lightning strategy, before it."""

    _sampler: _SkipOnce | None = None
    _snapshots_class: type
    """The package's callback that calls :meth:`_at_batch_start` (set by :func:`strategies`)."""
    _launcher_class: type
    """The package's :class:`_InProcessLauncher` (set by :func:`strategies`)."""

    def __init__(self, *args: Any, recovery: FitRecovery | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.recovery = recovery if recovery is not None else FitRecovery("Lightning")
        self._loop_at_start: str | None = None
        """The fit loop's state at the first entry that restored nothing (its counters at the
        start), for an entry that rolls back to the start."""
        self._callbacks_at_start: str | None = None
        """The callbacks' states at that entry (:func:`callback_states`), likewise."""
        self._rng_to_put_back: dict[str, Any] | None = None
        """The RNG states the restore of this entry put back, again at its first batch."""
        self._results_to_put_back: str | None = None
        """The logged metrics' accumulations of the restored step, put back at the entry's
        first batch (:func:`logged_results`)."""
        self._snapshot_step: int | None = None
        """The step of this entry's last snapshot: the batches of one step (gradient
        accumulation) take one, at the first of them."""
        self._skipped = 0
        """The batches the restore of this entry had the training loader's iterator leave out."""
        self._unyielded: tuple[int, int] | None = None
        """(epoch, the batches that epoch counts as done that its iterator never yielded),
        known at the epoch's first batch in this entry (:meth:`_data_position`)."""
        self._snapshots = self._snapshots_class(self)

    def kept_modules(self, model: Any) -> tuple[Any, ...]:
        """The modules kept through a regroup with their device meshes (none for DDP)."""
        return ()

    def setup(self, trainer: Any) -> None:
        super().setup(trainer)  # the DDP wrapper, the optimizers, the schedulers
        if trainer.state.fn != FITTING:
            return
        if trainer.callbacks[:1] != [self._snapshots]:  # first, before every other's hook
            trainer.callbacks = [self._snapshots,
                                 *(c for c in trainer.callbacks if c is not self._snapshots)]
        if not self.recovery.resuming:
            return
        if len(self.optimizers) != 1:
            raise EntryRuleBroken(f"in-process recovery of Lightning takes one optimizer, not "
                                  f"{len(self.optimizers)}")
        # The start is snapshotted at the first batch, after Lightning's own load (ckpt_path).
        restored = self.recovery.restore(self.lightning_module, self.optimizers[0],
                                         keep_start=False)
        callbacks = [c for c in trainer.callbacks if c is not self._snapshots]
        self._snapshot_step = None
        self._skipped, self._unyielded = 0, None
        if restored is None:  # nothing saved yet, or the start put back: so are the counters
            if self._loop_at_start is None:
                self._loop_at_start = json.dumps(trainer.fit_loop.state_dict())
                self._callbacks_at_start = callback_states(callbacks)
            else:
                trainer.fit_loop.load_state_dict(json.loads(self._loop_at_start))
                assert self._callbacks_at_start is not None
                load_callback_states(callbacks, self._callbacks_at_start)
            if self.recovery.entries > 1 or self.recovery.inprocess.generation > 0:
                self._rng_to_put_back = _rng_state()  # the start's, just put back
                self._results_to_put_back = json.dumps({})  # nothing logged at the start
            return
        extra = restored[1]["lightning"]
        for config, state in zip(trainer.lr_scheduler_configs, extra["schedulers"], strict=True):
            config.scheduler.load_state_dict(json.loads(state))
        trainer.fit_loop.load_state_dict(json.loads(extra["fit_loop"]))
        load_callback_states(callbacks, extra["callbacks"])
        self._rng_to_put_back = _rng_state()
        self._results_to_put_back = extra.get("results")
        # The batches of this epoch the iterator had yielded before the restored step.
        self._skipped = extra["data_position"]
        self._skip_batches(trainer.train_dataloader, self._skipped)

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

    def _at_batch_start(self, trainer: Any) -> None:
        """A training batch starts, before any callback's hook of it: the RNG put back after
        a restore, then the snapshot of the step before it."""
        if self._rng_to_put_back is not None:
            _set_rng_state(self._rng_to_put_back)
            self._rng_to_put_back = None
        results = trainer.fit_loop.epoch_loop._results
        if self._results_to_put_back is not None:
            # After Lightning reset them at the entry's epoch start.
            put_back_logged_results(results, self._results_to_put_back)
            self._results_to_put_back = None
        position = self._data_position(trainer)
        step = trainer.global_step
        module, optimizer = self.lightning_module, self.optimizers[0]
        if step == 0:  # the start, once Lightning loaded its own checkpoint if it had one
            self.recovery.keep_start(module, optimizer)
            return
        if step in (self.recovery.restored_step, self._snapshot_step):
            return  # nothing new since the entry, or a later batch of an accumulated step
        self._snapshot_step = step
        self.recovery.save(step, module, optimizer, {"lightning": {
            # JSON strings: a snapshot keeps leaves (not empty containers) under str keys.
            "fit_loop": json.dumps(trainer.fit_loop.state_dict()),
            "schedulers": [json.dumps(c.scheduler.state_dict())
                           for c in trainer.lr_scheduler_configs],
            "callbacks": callback_states(c for c in trainer.callbacks
                                         if c is not self._snapshots),
            "results": logged_results(results),
            "data_position": position,
        }}, record=False)

    def _data_position(self, trainer: Any) -> int:
        """The batches the training loader's iterator yielded this epoch before this batch:
        the epoch's batches done (Lightning's counter) less those its iterator never yielded,
        which the epoch's first batch in an entry tells (a plain loader's iterator starts at
        the epoch's start, or as many batches in as the restore had it skip)."""
        epoch = trainer.current_epoch
        done = trainer.fit_loop.epoch_loop.batch_progress.current.completed
        if self._unyielded is None or self._unyielded[0] != epoch:
            self._unyielded = (epoch, done - self._skipped)
            self._skipped = 0  # the next epoch's iterator starts at its start
        return done - self._unyielded[1]

    def optimizer_step(self, *args: Any, **kwargs: Any) -> Any:
        """Lightning's optimizer step, recorded for the report as it ends: its snapshot waits
        for the next batch, and a step a failure then rolls back still counts as done once."""
        done = super().optimizer_step(*args, **kwargs)
        # Lightning counts the step (trainer.global_step) once this returns.
        self.recovery.step_done(self.lightning_module.trainer.global_step + 1)
        return done


class _InProcessDDP(_InProcessFit):
    """Lightning's DDP strategy, whose ``fit`` a peer failure costs a roll-back in process.

    Takes DDPStrategy's arguments; ``recovery`` is for tests and for checkpoint options
    (``FitRecovery("lightning", ckpt_dir=...)``).
    """

    strategy_name = "elasticft_ddp"

    def _configure_launcher(self) -> None:
        super()._configure_launcher()
        assert self.cluster_environment is not None and self._launcher is not None
        if self.cluster_environment.creates_processes_externally:  # by elasticft-run
            self._launcher = self._launcher_class(self, self._launcher)


class _InProcessModelParallel(_InProcessFit):
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
            self._launcher = self._launcher_class(self, None)

    def setup_environment(self) -> None:
        if self._device_mesh is None:
            super().setup_environment()
        else:  # a later entry: the kept mesh, not a new one with new groups
            self.lightning_module._device_mesh = self._device_mesh

    def kept_modules(self, model: Any) -> tuple[Any, ...]:
        return (model,)

    def model_to_device(self) -> None:
        # A later entry's module is the kept one, placed by the first entry. Lightning's move
        # would swap each DTensor parameter in place for no change (torch's ``_apply``), which
        # torch refuses while anything else still holds one; InProcess's release names such a
        # parameter (the failed step's graph kept by something, seen once under load).
        if self.recovery.entries > 1 and _all_on(self.model, self.root_device):
            return
        super().model_to_device()


def _all_on(module: Any, device: Any) -> bool:
    """Whether every parameter and buffer of ``module`` is on ``device`` (a DTensor: its local
    shard)."""
    return all(t.device == device for t in [*module.parameters(), *module.buffers()])


def callback_states(callbacks: Any) -> str:
    """What Lightning's checkpoint keeps of ``callbacks`` (each one's non-empty
    ``state_dict()`` under its ``state_key``) and their :data:`DECISION_FIELDS`, as one JSON
    string: ``torch.save``'s bytes in base64, as Lightning writes them (a state may hold
    tensors and other objects a snapshot's JSON does not)."""
    states = {}
    for callback in callbacks:
        state = callback.state_dict()
        fields = {name: vars(callback)[name] for name in DECISION_FIELDS if name in vars(callback)}
        if state or fields:
            states[callback.state_key] = {"state": state, "fields": fields}
    buffer = io.BytesIO()
    torch.save(states, buffer)
    return base64.b64encode(buffer.getvalue()).decode("ascii")


def load_callback_states(callbacks: Any, encoded: str) -> None:
    """Puts :func:`callback_states`'s ``encoded`` back into ``callbacks``, each by its
    ``state_key`` (``load_state_dict``, as Lightning's resume does, then the fields)."""
    # This job's own bytes, from its memory: they hold what the callbacks' states hold.
    states = torch.load(io.BytesIO(base64.b64decode(encoded)), weights_only=False)
    for callback in callbacks:
        taken = states.get(callback.state_key)
        if taken is None:
            continue
        if taken["state"]:
            callback.load_state_dict(taken["state"])
        for name, value in taken["fields"].items():
            setattr(callback, name, value)


def logged_results(results: Any) -> str:
    """The accumulations of the values a module logged with ``self.log`` this epoch (Lightning's
    training ``_ResultCollection``: a sum, a max, a mean's weighted sum and batch count), as one
    JSON string: an epoch-level metric (``on_epoch=True``, what ``EarlyStopping`` and
    ``ModelCheckpoint(monitor=...)`` read) covers every batch of the epoch, so a step redone must
    find it as it was at that step. Lightning's checkpoints do not hold it; its own mid-epoch
    resume starts the epoch's metrics over. ``torchmetrics.Metric`` objects logged as values
    keep their state in the module, not here."""
    taken = {}
    for key, metric in results.items():
        if not metric.is_tensor:
            continue
        batches = metric.cumulated_batch_size if metric.meta.is_mean_reduction else None
        taken[key] = {"dtype": str(metric.value.dtype).removeprefix("torch."),
                      "value": metric.value.tolist(),
                      "batches": None if batches is None else int(batches),
                      "updates": metric._update_count, "has_reset": metric.has_reset}
    return json.dumps(taken)


def put_back_logged_results(results: Any, encoded: str) -> None:
    """Puts :func:`logged_results`'s accumulations back: into the entries there now, and into
    each again right before its next update. Lightning resets a hook's values at its first
    ``self.log`` of a run's first batch (it starts the epoch's metrics over on a resume), and a
    replacement's entries are made only by that call."""
    taken: dict[str, dict[str, Any]] = json.loads(encoded)
    for key, metric in results.items():
        if key in taken:
            _load_logged(metric, taken[key])
        elif metric.is_tensor:
            metric.reset()  # logged only after the restored step
    update = type(results).update_metrics

    def update_metrics(key: str, value: Any, batch_size: int) -> None:
        state = taken.pop(key, None)
        if state is not None:
            _load_logged(results[key], state)
        if not taken:
            del results.update_metrics  # Lightning's own again
        update(results, key, value, batch_size)

    if taken:
        results.update_metrics = update_metrics


def _load_logged(metric: Any, state: dict[str, Any]) -> None:
    device = metric.value.device
    metric.value = torch.tensor(state["value"], dtype=getattr(torch, state["dtype"]),
                                device=device)
    if state["batches"] is not None:
        metric.cumulated_batch_size = torch.tensor(state["batches"], device=device)
    metric._update_count = state["updates"]
    metric.has_reset = state["has_reset"]
    metric._computed = None


def _rng_state() -> dict[str, Any]:
    from elasticft.ckpt.restoring.state import rng_state

    return rng_state()


def _set_rng_state(state: dict[str, Any]) -> None:
    from elasticft.ckpt.restoring.state import set_rng_state

    set_rng_state(state)


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


class _Snapshots:
    """The callback that takes the snapshot at a training batch's start, placed first in
    ``trainer.callbacks`` by the strategy's ``setup`` (its state is empty: Lightning's
    checkpoints do not hold it). Mixed into the package's ``Callback``."""

    def __init__(self, strategy: _InProcessFit) -> None:
        self.strategy = strategy

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any,
                             batch_idx: int) -> None:
        self.strategy._at_batch_start(trainer)


class _InProcessLauncher:
    """Lightning's launcher, whose function runs under recovery: the process group is made
    once, recovery arms, and the function is entered again after each regroup. Mixed into
    the package's ``_Launcher``."""

    def __init__(self, strategy: Any, inner: Any) -> None:
        self.strategy = strategy
        self.inner = inner
        """The strategy's own launcher; None where Lightning has none (the function is called)."""

    @property
    def is_interactive_compatible(self) -> bool:
        return self.inner.is_interactive_compatible if self.inner is not None else True

    def launch(self, function: Callable[..., Any], *args: Any, trainer: Any = None,
               **kwargs: Any) -> Any:
        if trainer is None or trainer.state.fn != FITTING:  # validate, test, predict
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


class Strategies(NamedTuple):
    """The in-process strategies made for one Lightning package."""

    ddp: type
    model_parallel: type


@functools.cache
def strategies(package: str) -> Strategies:
    """The in-process strategies of ``package`` (one of :data:`PACKAGES`, imported here):
    subclasses of its ``DDPStrategy`` and ``ModelParallelStrategy``, made once per package."""
    if package not in PACKAGES:
        raise ValueError(f"Lightning package {package!r}: use one of {', '.join(PACKAGES)}")
    lightning = importlib.import_module(package)
    base_launcher = importlib.import_module(f"{package}.strategies.launchers.launcher")._Launcher
    launcher = type("_InProcessLauncher", (_InProcessLauncher, base_launcher),
                    {"__module__": __name__, "__doc__": _InProcessLauncher.__doc__})
    snapshots = type("_Snapshots", (_Snapshots, lightning.Callback),
                     {"__module__": __name__, "__doc__": _Snapshots.__doc__})
    made = {}
    for name, mixin, base in (("InProcessDDPStrategy", _InProcessDDP,
                               lightning.strategies.DDPStrategy),
                              ("InProcessModelParallelStrategy", _InProcessModelParallel,
                               lightning.strategies.ModelParallelStrategy)):
        made[name] = type(name, (mixin, base), {
            "__module__": __name__, "__doc__": mixin.__doc__, "__qualname__": name,
            "_launcher_class": launcher, "_snapshots_class": snapshots})
    return Strategies(made["InProcessDDPStrategy"], made["InProcessModelParallelStrategy"])


class _OfThePackageInUse(type):
    """The type of the names a script imports: calling one makes the strategy of the Lightning
    package the script imported (``package=`` names it), and ``isinstance`` holds for either
    package's. ``.of(package)`` is the class itself, to subclass."""

    _kind: str

    def __call__(cls, *args: Any, package: str | None = None, **kwargs: Any) -> Any:
        chosen = package or package_in_use(sys.modules, _installed)
        return cls.of(chosen)(*args, **kwargs)

    def of(cls, package: str) -> type:
        return getattr(strategies(package), cls._kind)

    def __instancecheck__(cls, instance: Any) -> bool:
        return any(isinstance(instance, cls.of(p)) for p in PACKAGES if p in sys.modules)

    def __subclasscheck__(cls, subclass: type) -> bool:
        return any(issubclass(subclass, cls.of(p)) for p in PACKAGES if p in sys.modules)


class InProcessDDPStrategy(metaclass=_OfThePackageInUse):
    """Lightning's DDP strategy, whose ``fit`` a peer failure costs a roll-back in process.

    Takes DDPStrategy's arguments; ``recovery`` is for tests and for checkpoint options
    (``FitRecovery("lightning", ckpt_dir=...)``); ``package`` names the Lightning package where
    a script imported both (``"pytorch_lightning"``; else the one it imported).
    """

    _kind = "ddp"


class InProcessModelParallelStrategy(metaclass=_OfThePackageInUse):
    """Lightning's model-parallel strategy (FSDP2's ``fully_shard`` and tensor parallel,
    applied in ``configure_model``), whose ``fit`` a peer failure costs a roll-back in process,
    the survivors keeping their sharded module.

    Takes ModelParallelStrategy's arguments, ``recovery`` and ``package`` (as
    :class:`InProcessDDPStrategy`).
    """

    _kind = "model_parallel"
