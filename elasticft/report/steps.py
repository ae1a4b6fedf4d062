"""Step records: when each training step finished, written by the workers, read by the report.

The report needs per-step progress to tell useful work from lost work. The agent gives every
worker ``ELASTICFT_STEP_LOG``, the path of a JSONL file of its own (``<run_dir>/steps/
rank<R>.jsonl``, appended to across restarts). A worker appends one line per finished step::

    {"time": 1718000000.25, "step": 42, "ckpt_s": 0.31}

``time`` is the wall clock when the step finished, ``step`` the number of steps done so far (so a
run resumed from a checkpoint at step 40 writes 41, 42, ... again), ``ckpt_s`` (optional) the
seconds that step spent saving a checkpoint. A plain script needs no import to do this (see
``examples/train_plain.py``); :class:`StepRecorder` does it for scripts that import elasticft.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from collections.abc import Mapping
from pathlib import Path

from elasticft.agent.api import AgentCollaborator, GroupInfo, WorkerInfo

STEP_LOG_ENV = "ELASTICFT_STEP_LOG"
STEPS_DIR = "steps"


class StepLogEnv(AgentCollaborator):
    """Gives each worker the path of its step-record file."""

    def worker_env(self, group: GroupInfo, worker: WorkerInfo) -> Mapping[str, str]:
        directory = Path(group.run_dir) / STEPS_DIR
        directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        return {STEP_LOG_ENV: str(directory / f"rank{worker.global_rank}.jsonl")}


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

    def record(self, step: int, ckpt_s: float | None = None) -> None:
        if self._fd is None:
            return
        record: dict[str, float | int] = {"time": time.time(), "step": int(step)}
        if ckpt_s is not None:
            record["ckpt_s"] = round(float(ckpt_s), 6)
        # One write() per line on an O_APPEND descriptor: a crash never leaves half a line
        # in the middle of the file.
        os.write(self._fd, (json.dumps(record) + "\n").encode())

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


@dataclasses.dataclass(frozen=True)
class StepRecord:
    time: float
    step: int
    rank: int
    ckpt_s: float = 0.0


def read_steps(run_dir: Path) -> dict[int, list[StepRecord]]:
    """Step records by global rank, in file order (= time order per rank); torn lines skipped."""
    by_rank: dict[int, list[StepRecord]] = {}
    for path in sorted(Path(run_dir).rglob(f"{STEPS_DIR}/rank*.jsonl")):
        try:
            rank = int(path.stem.removeprefix("rank"))
        except ValueError:
            continue
        records = by_rank.setdefault(rank, [])
        with open(path) as f:
            for line in f:
                try:
                    data = json.loads(line)
                    records.append(StepRecord(float(data["time"]), int(data["step"]), rank,
                                              float(data.get("ckpt_s") or 0.0)))
                except (ValueError, KeyError, TypeError):
                    continue
    for records in by_rank.values():
        records.sort(key=lambda r: r.time)
    return by_rank
