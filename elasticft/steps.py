"""Step records: when each training step finished, written by the workers, read by the report.

The report needs per-step progress to tell useful work from lost work. The agent gives every
worker ``ELASTICFT_STEP_LOG`` (:data:`STEP_LOG_ENV`, set by
:class:`elasticft.agent.steplog.StepLogEnv`), the path of a JSONL file of its own
(``<run_dir>/steps/rank<R>.jsonl``, appended to across restarts). A worker appends one line per
finished step::

    {"time": 1718000000.25, "step": 42, "ckpt_s": 0.31}

``time`` is the wall clock when the step finished, ``step`` the number of steps done so far (so a
run resumed from a checkpoint at step 40 writes 41, 42, ... again), ``ckpt_s`` (optional) the
seconds that step spent saving a checkpoint. A script can write these lines itself with no import
(see ``examples/train_plain.py``); :class:`StepRecorder` does it for scripts that import elasticft.

A script that writes none still gets records: the worker bootstrap (the ``sitecustomize`` the
agent puts first on ``PYTHONPATH``, :mod:`elasticft.diag.autoinstall`) installs
:class:`AutoStepRecorder` when torch is imported. It records the steps of the first optimizer
that steps, through torch's global optimizer step hooks, in a file beside the explicit one
(``rank<R>.auto.jsonl``). Each record carries the optimizer's own step count
(``state[p]["step"]``, which Adam-like optimizers keep), read at every step, so the number
follows the training through whatever sets that count back or forward: a restart that loads a
checkpoint (elasticft's Checkpointer, DCP's ``set_state_dict``, a plain ``load_state_dict``)
and an in-process recovery that restores the live optimizer in place. A step redone after
either has a number reached before, and the report counts it as rollback.

Two kinds of optimizer call are not training steps, and two kinds of count cannot be read cheaply:

* The zero-gradient step DCP's ``get_state_dict`` takes to give a fresh optimizer its state
  (learning rate 0, every gradient zero, no state yet: :func:`is_init_step`) is not recorded.
* A count kept on the accelerator (fused or capturable optimizers) would make the host wait
  for the device if read at every step; it is read when its tensor is new or was written
  by something other than a step (:func:`must_read`), and counted on in between.
* An optimizer with no count (plain SGD) gives no real step: its records are numbered on from
  the last record and marked ``"counted": true``, and the report says the step is not known
  (:func:`number_step`).

:func:`read_steps` takes a rank's explicit records when it has any and its automatic ones
otherwise, so a step is never counted twice.

This module is the one owner of the format, the file names and the variable: the writers run in
every worker (so it imports only the standard library), the reader serves ``elasticft report``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

STEP_LOG_ENV = "ELASTICFT_STEP_LOG"
WORKER_ENV = frozenset({STEP_LOG_ENV})
"""Worker variables of the step records (listed in the agent's WORKER_ENV_NAMES)."""
STEPS_DIR = "steps"
AUTO_SUFFIX = ".auto"


def step_log_path(run_dir: Path, global_rank: int) -> Path:
    """The file a rank appends its explicit step records to."""
    return Path(run_dir) / STEPS_DIR / f"rank{global_rank}.jsonl"


def auto_step_path(step_log: Path) -> Path:
    """The file of automatic records beside a worker's explicit ``rank<R>.jsonl``."""
    return step_log.with_name(f"{step_log.stem}{AUTO_SUFFIX}{step_log.suffix}")


class StepRecorder:
    """Appends step records to ``ELASTICFT_STEP_LOG`` (a no-op when the variable is unset)."""

    def __init__(self, path: Path | None) -> None:
        self.path = path
        self._fd = (
            os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600) if path else None
        )

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> StepRecorder:
        value = (os.environ if env is None else env).get(STEP_LOG_ENV)
        return cls(Path(value) if value else None)

    def record(self, step: int, ckpt_s: float | None = None, *, counted: bool = False) -> None:
        if self._fd is None:
            return
        record: dict[str, float | int | bool] = {"time": time.time(), "step": int(step)}
        if ckpt_s is not None:
            record["ckpt_s"] = round(float(ckpt_s), 6)
        if counted:
            record["counted"] = True
        # One write() per line on an O_APPEND descriptor: a crash never leaves half a line
        # in the middle of the file.
        os.write(self._fd, (json.dumps(record) + "\n").encode())

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


class AutoStepRecorder:
    """Appends a step record at every training step of one optimizer (the first that steps in
    this process), from torch's global optimizer step hooks. Never raises into the script."""

    def __init__(self, path: Path) -> None:
        self._recorder = StepRecorder(path)
        self._path = path
        self._optimizer_id: int | None = None
        self._step: int | None = None
        self._count = CountView(None)
        self._count_delta: int | None = None
        self._init_step = False
        self._handles: list[Any] = []

    def install(self) -> AutoStepRecorder:
        from torch.optim.optimizer import (
            register_optimizer_step_post_hook,
            register_optimizer_step_pre_hook,
        )

        self._handles = [register_optimizer_step_pre_hook(self.before_step),
                         register_optimizer_step_post_hook(self.on_step)]
        return self

    def before_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        try:
            if self._optimizer_id not in (None, id(optimizer)):
                return
            # Only a fresh optimizer can be in DCP's initialising step: the rest of the check
            # (every gradient zero) runs at most once per optimizer.
            self._init_step = not optimizer.state and is_init_step(
                bool(optimizer.state), [group.get("lr") for group in optimizer.param_groups],
                _grads_zero(optimizer))
        except Exception:  # a lost record must never stop training
            self.close()

    def on_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        try:
            if self._optimizer_id is None:
                self._optimizer_id = id(optimizer)
            elif id(optimizer) != self._optimizer_id:
                return
            if self._init_step:
                self._init_step = False
                self._count = CountView(None)  # the count it left is not a training step's
                return
            own = self._own_step(optimizer)
            last = last_recorded_step(self._path) if self._step is None and own is None else 0
            self._step, counted = number_step(own, self._step, last)
            self._recorder.record(self._step, counted=counted)
        except Exception:  # a lost record must never stop training
            self.close()

    def _own_step(self, optimizer: Any) -> int | None:
        value = optimizer_step_value(optimizer)
        if value is None:
            return None
        view = CountView.of(value)
        delta = view.version - self._count.version if view.same_tensor(self._count) else None
        if self._step is not None and not must_read(view, self._count, self._count_delta):
            self._count, self._count_delta = view, delta
            return self._step + 1
        self._count, self._count_delta = view, delta
        return int(value)

    def close(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []
        self._recorder.close()


@dataclasses.dataclass(frozen=True)
class CountView:
    """What can be seen of an optimizer's step count without reading its value: where it lives,
    which tensor it is, and how many in-place writes that tensor has had (torch's version
    counter)."""

    identity: int | None
    """``id`` of the tensor (None: no count seen, or a plain number)."""
    on_device: bool = False
    version: int = 0

    @classmethod
    def of(cls, value: Any) -> CountView:
        if not hasattr(value, "_version"):
            return cls(None)
        return cls(id(value), value.device.type != "cpu", int(value._version))

    def same_tensor(self, other: CountView) -> bool:
        return self.identity is not None and self.identity == other.identity


def must_read(now: CountView, before: CountView, delta_before: int | None) -> bool:
    """Whether the optimizer's step count must be read at this step (pure).

    A number or a count in host memory is read at every step (no cost). A count on the device
    is read when its tensor is not the one of the last step (a ``load_state_dict`` made a new
    one), or when it had a different number of in-place writes than the step before (a restore
    copied into it); otherwise the step counts on from the last one.
    """
    if now.identity is None or not now.on_device:
        return True
    if not now.same_tensor(before) or delta_before is None:
        return True
    return now.version - before.version != delta_before


def number_step(own: int | None, previous: int | None,
                last_recorded: int) -> tuple[int, bool]:
    """The number of a finished step and whether it is only counted (pure).

    ``own``: the optimizer's step count after the step (None: it keeps none); ``previous``: the
    number this process gave its last step (None: none yet); ``last_recorded``: the last number
    in the rank's file (earlier processes). The optimizer's count is the training's step; without
    one the steps are counted on, which cannot see a restore.
    """
    if own is not None:
        return own, False
    if previous is not None:
        return previous + 1, True
    return last_recorded + 1, True


def is_init_step(has_state: bool, lrs: Sequence[Any], grads_zero: bool) -> bool:
    """Whether an optimizer step is the state-initialising step of DCP's ``get_state_dict``
    (pure): a fresh optimizer (no ``state``), stepped with every learning rate 0 and every
    gradient zero, which changes nothing but creates the state tensors. A real first step has a
    learning rate or a gradient."""
    if has_state or not lrs or not grads_zero:
        return False
    return all(lr is not None and float(lr) == 0.0 for lr in lrs)


def _grads_zero(optimizer: Any) -> bool:
    grads = [p.grad for group in optimizer.param_groups for p in group["params"]]
    return all(g is None or not bool(g.any()) for g in grads)


def optimizer_step_value(optimizer: Any) -> Any:
    """The optimizer's own step count as it keeps it (a tensor or a number; Adam, AdamW,
    RMSprop... keep ``state[p]["step"]`` and restore it with a checkpoint), or None when it
    keeps none (SGD)."""
    for group in optimizer.param_groups:
        for param in group["params"]:
            value = optimizer.state.get(param, {}).get("step")
            if value is not None:
                return value
    return None


def last_recorded_step(path: Path) -> int:
    """The step of the last whole record in ``path`` (0 when there is none)."""
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - 4096))
            lines = f.read().splitlines()
    except OSError:
        return 0
    for line in reversed(lines):
        try:
            return int(json.loads(line)["step"])
        except (ValueError, KeyError, TypeError):
            continue
    return 0


@dataclasses.dataclass(frozen=True)
class StepRecord:
    """One line of a rank's step file: the step it finished, and when."""

    time: float
    step: int
    rank: int
    ckpt_s: float = 0.0
    """Seconds the step spent in its checkpoint call (0: none, or not said)."""
    counted: bool = False
    """An automatic record numbered by counting optimizer calls (rollbacks not visible)."""
    automatic: bool = False


def _read_file(path: Path, rank: int, automatic: bool) -> list[StepRecord]:
    records = []
    with open(path) as f:
        for line in f:
            try:
                data = json.loads(line)
                records.append(StepRecord(float(data["time"]), int(data["step"]), rank,
                                          float(data.get("ckpt_s") or 0.0),
                                          bool(data.get("counted")), automatic))
            except (ValueError, KeyError, TypeError):
                continue
    return records


def read_steps(run_dir: Path) -> dict[int, list[StepRecord]]:
    """Step records by global rank in time order; torn lines skipped. A rank's explicit records
    win over its automatic ones (a script that writes its own must not be counted twice)."""
    explicit: dict[int, list[StepRecord]] = {}
    automatic: dict[int, list[StepRecord]] = {}
    for path in sorted(Path(run_dir).rglob(f"{STEPS_DIR}/rank*.jsonl")):
        name = path.name.removeprefix("rank").removesuffix(".jsonl")
        is_auto = name.endswith(AUTO_SUFFIX)
        try:
            rank = int(name.removesuffix(AUTO_SUFFIX))
        except ValueError:
            continue
        target = automatic if is_auto else explicit
        target.setdefault(rank, []).extend(_read_file(path, rank, is_auto))
    return merge_steps(explicit, automatic)


def read_rank_steps(run_dir: Path, rank: int) -> list[StepRecord]:
    """One rank's records in time order, as :func:`read_steps` gives them, reading only its
    own files (the agent, which knows where its workers write)."""
    explicit_path = step_log_path(run_dir, rank)
    found: dict[bool, list[StepRecord]] = {}
    for path, is_auto in ((explicit_path, False), (auto_step_path(explicit_path), True)):
        with contextlib.suppress(FileNotFoundError):
            found[is_auto] = _read_file(path, rank, is_auto)
    merged = merge_steps({rank: found.get(False, [])}, {rank: found.get(True, [])})
    return merged.get(rank, [])


def merge_steps(explicit: Mapping[int, list[StepRecord]],
                automatic: Mapping[int, list[StepRecord]]) -> dict[int, list[StepRecord]]:
    """Per rank: the explicit records if there are any, else the automatic ones; time order."""
    merged = {}
    for rank in sorted(set(explicit) | set(automatic)):
        records = explicit.get(rank) or automatic.get(rank) or []
        merged[rank] = sorted(records, key=lambda r: r.time)
    return merged
