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
:class:`AutoStepRecorder` when torch is imported. It
counts the steps of the first optimizer that steps, through torch's global optimizer step hook,
and appends the same lines to a file beside the explicit one (``rank<R>.auto.jsonl``). The
number of a process's first step is the optimizer's own (``state[p]["step"]``, which Adam-like
optimizers keep and restore with the checkpoint), so steps redone after a restart are told
apart; later steps count on from it. For an optimizer without one (plain SGD) it continues from
the last recorded number, marked ``"counted": true``. :func:`read_steps`
takes a rank's explicit records when it has any and its automatic ones otherwise, so a step is
never counted twice.

This module is the one owner of the format, the file names and the variable: the writers run in
every worker (so it imports only the standard library), the reader serves ``elasticft report``.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from collections.abc import Mapping
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
    """Appends a step record at every step of one optimizer (the first that steps in this
    process), from torch's global optimizer step post-hook. Never raises into the script."""

    def __init__(self, path: Path) -> None:
        self._recorder = StepRecorder(path)
        self._path = path
        self._optimizer_id: int | None = None
        self._step: int | None = None
        self._counted = False
        self._handle: Any = None

    def install(self) -> AutoStepRecorder:
        from torch.optim.optimizer import register_optimizer_step_post_hook

        self._handle = register_optimizer_step_post_hook(self.on_step)
        return self

    def on_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        try:
            if self._optimizer_id is None:
                self._optimizer_id = id(optimizer)
            elif id(optimizer) != self._optimizer_id:
                return
            if self._step is None:
                # Read once: the step count of a fused or capturable optimizer lives on the GPU,
                # and reading it every step would make the host wait for the device.
                own = optimizer_step(optimizer)
                self._counted = own is None
                self._step = last_recorded_step(self._path) + 1 if own is None else own
            else:
                self._step += 1
            self._recorder.record(self._step, counted=self._counted)
        except Exception:  # a lost record must never stop training
            self.close()

    def close(self) -> None:
        if self._handle is not None:
            self._handle.remove()
            self._handle = None
        self._recorder.close()


def optimizer_step(optimizer: Any) -> int | None:
    """The optimizer's own step count (Adam, AdamW, RMSprop... keep ``state[p]["step"]`` and
    restore it with a checkpoint), or None when it keeps none (SGD)."""
    for group in optimizer.param_groups:
        for param in group["params"]:
            value = optimizer.state.get(param, {}).get("step")
            if value is not None:
                return int(value)
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
    time: float
    step: int
    rank: int
    ckpt_s: float = 0.0
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


def merge_steps(explicit: Mapping[int, list[StepRecord]],
                automatic: Mapping[int, list[StepRecord]]) -> dict[int, list[StepRecord]]:
    """Per rank: the explicit records if there are any, else the automatic ones; time order."""
    merged = {}
    for rank in sorted(set(explicit) | set(automatic)):
        records = explicit.get(rank) or automatic.get(rank) or []
        merged[rank] = sorted(records, key=lambda r: r.time)
    return merged
