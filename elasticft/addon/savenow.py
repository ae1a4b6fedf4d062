"""The last checkpoint before the machine goes away, by a deadline.

Slurm's time-limit signal and a preemption notice (a cloud's or Kubernetes') ask the same of
the agent: make the job's newest state durable before a deadline, then let the run end. There
is one way to do it, :meth:`SaveBeforeExit.save`:

* **A job that uses the worker API** (the checkpoint service holds its snapshots): the
  checkpoint service's "checkpoint now" asks every worker's control thread for its newest
  snapshot (a copy still in flight is finished first, even while the main thread is stuck in a
  collective), waits for the acks and persists that step to the local directory and the remote
  one; True once it is durable.
* **A plain script** (the service holds nothing): the signal is forwarded to every worker, which
  saves on it and exits (``examples/train_plain.py``); the save counts as done once every worker
  has exited with 0.

The caller chooses the deadline and the signal; what happened comes back as (durable, how) for
its event log.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import signal
import time
from collections.abc import Callable
from typing import Protocol, runtime_checkable

from elasticft import procs
from elasticft.addon.api import GroupInfo, run_ending_errors

logger = logging.getLogger(__name__)


@runtime_checkable
class CheckpointNow(Protocol):
    """The checkpoint service's "save now and wait until durable" (worker-API jobs)."""

    def checkpoint_now(self, reason: str, timeout: float) -> bool: ...


def describe_status(status: int) -> str:
    if os.WIFSIGNALED(status):
        return f"killed by {signal.Signals(os.WTERMSIG(status)).name}"
    return f"exit {os.WEXITSTATUS(status)}"


@dataclasses.dataclass
class SaveBeforeExit:
    """Makes the newest state durable before a deadline (see the module docstring)."""

    checkpointer: CheckpointNow | None
    clock: Callable[[], float] = time.monotonic
    poll_interval: float = 0.1
    """Seconds between checks of whether the signalled workers have exited."""

    def uses_worker_api(self, group: GroupInfo) -> bool:
        """Whether the checkpoint service holds this node's snapshots. Workers that never used
        the worker API leave it empty; asking them would only spend the time left waiting for
        acks that cannot come."""
        if self.checkpointer is None:
            return False
        newest = getattr(self.checkpointer, "newest_common_step", None)
        if not callable(newest):
            return True
        try:
            return newest(group) is not None
        except run_ending_errors():
            raise
        except Exception:
            logger.debug("checkpoint service could not tell its newest snapshot", exc_info=True)
            return True

    def save(self, group: GroupInfo, deadline: float, sig: signal.Signals, reason: str
             ) -> tuple[bool, str]:
        """Saves by ``deadline`` (of ``clock``); ``sig`` is what a plain script is sent."""
        timeout = max(deadline - self.clock(), 1.0)
        if self.checkpointer is not None and self.uses_worker_api(group):
            try:
                if self.checkpointer.checkpoint_now(reason, timeout):
                    return True, "checkpoint service acknowledged"
                # No snapshot to persist: a plain script (no worker API); it saves on the signal.
                logger.info("the checkpoint service holds no snapshot; forwarding %s instead",
                            sig.name)
            except run_ending_errors():
                raise
            except Exception:
                logger.exception("checkpoint service failed; forwarding the signal instead")
        return self.forward_and_wait(group, deadline, sig)

    def forward_and_wait(self, group: GroupInfo, deadline: float, sig: signal.Signals
                         ) -> tuple[bool, str]:
        """Sends ``sig`` to every worker and waits (until ``deadline``) for all to exit."""
        pids = [w.pid for w in group.workers if w.pid]
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)
        logger.info("forwarded %s to workers %s; waiting for them to save and exit",
                    sig.name, pids)
        statuses: dict[int, int] = {}
        while self.clock() < deadline:
            for pid in pids:
                if pid not in statuses:
                    status = procs.exit_status(pid)
                    if status is not None:
                        statuses[pid] = status
            if len(statuses) == len(pids):
                break
            time.sleep(self.poll_interval)
        if len(statuses) < len(pids):
            left = sorted(set(pids) - set(statuses))
            return False, f"workers {left} still running at the deadline"
        bad = {pid: describe_status(s) for pid, s in statuses.items() if s != 0}
        if bad:
            return False, "workers did not exit cleanly after the signal: " + ", ".join(
                f"{pid} {what}" for pid, what in sorted(bad.items()))
        return True, f"{len(pids)} worker(s) saved and exited"
