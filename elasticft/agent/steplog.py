"""The agent add-on that gives each worker its step-record file (:mod:`elasticft.steps`).

Every worker gets ``ELASTICFT_STEP_LOG`` and, so that scripts which write no records still get
them, the diagnostics bootstrap first on ``PYTHONPATH`` (its ``sitecustomize`` installs the
optimizer-step recorder once torch is imported; :mod:`elasticft.diag.autoinstall`).

The records are also how the agent knows whether an attempt completed a step: the files'
sizes when its workers started against their sizes when it failed (the policy's
``FailureFacts.step_completed``; a failure that repeats before the first step stops the run),
and where the job is when it fails (``FailureFacts.newest_step``: a failure that comes back at
the same step after an in-process recovery is answered by a restart).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import ClassVar

from elasticft.addon.api import AddOn, AddOnContext, AgentCollaborator, GroupInfo, WorkerInfo
from elasticft.addon.classify import FailureRecord
from elasticft.addon.policy import KnownFacts
from elasticft.diag.workerenv import bootstrap_dir
from elasticft.steps import (
    AUTO_SUFFIX,
    STEP_LOG_ENV,
    STEPS_DIR,
    last_recorded_step,
    step_log_path,
)


class StepLogEnv(AgentCollaborator):
    """Gives each worker the path of its step-record file, and the bootstrap that records
    optimizer steps for scripts that write no records themselves."""

    def __init__(self) -> None:
        self._sizes_at_start: dict[Path, int] = {}

    def worker_env(self, group: GroupInfo, worker: WorkerInfo) -> Mapping[str, str]:
        path = step_log_path(Path(group.run_dir), worker.global_rank)
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        return {STEP_LOG_ENV: str(path)}

    def python_path(self) -> tuple[Path, ...]:
        return (bootstrap_dir(),)

    def on_workers_started(self, group: GroupInfo) -> None:
        self._sizes_at_start = record_sizes(Path(group.run_dir))

    def failure_facts(self, group: GroupInfo, failures: tuple[FailureRecord, ...]
                      ) -> KnownFacts:
        now = record_sizes(Path(group.run_dir))
        grown = any(size > self._sizes_at_start.get(path, 0) for path, size in now.items())
        return {"step_completed": grown, "newest_step": newest_step(now)}


def newest_step(files: Iterable[Path]) -> int | None:
    """The newest step the ranks' step-record files end with (None: no file has a record). A
    step redone after a roll-back is written again, so a file's last record is where its rank
    is now, not the furthest it ever got."""
    files = set(files)
    # A rank's explicit records when it writes any (as the report reads them), else its
    # automatic ones: the two may number steps differently.
    read = [path for path in files if not path.name.endswith(f"{AUTO_SUFFIX}.jsonl")
            or path.with_name(path.name.replace(f"{AUTO_SUFFIX}.jsonl", ".jsonl")) not in files]
    steps = [last_recorded_step(path) for path in read]
    return max(steps) if any(steps) else None


def record_sizes(run_dir: Path) -> dict[Path, int]:
    """The size of every step-record file of the run (explicit and automatic), by path."""
    sizes = {}
    for path in (run_dir / STEPS_DIR).glob("rank*.jsonl"):
        try:
            sizes[path] = path.stat().st_size
        except OSError:  # removed meanwhile
            continue
    return sizes


class StepLogAddOn(AddOn[StepLogEnv]):
    """Step records as an add-on of the agent (:class:`elasticft.addon.api.AddOn`): always on."""

    name: ClassVar[str] = "steps"

    def build(self, context: AddOnContext, built: Mapping[str, AgentCollaborator | None]
              ) -> StepLogEnv:
        return StepLogEnv()
