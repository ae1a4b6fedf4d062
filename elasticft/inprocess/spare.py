"""A pre-started spare, the worker's side: a process that has run the script's set-up before any
failure, and takes a failed rank's place in process.

With ``--recovery-inprocess-spare`` the agent starts, beside the workers, one more process of
the same script: the **spare**. It runs as a one-member world of its own (rank 0 of 1, a private
store, none of the ranks' checkpoint memory or diagnostics files), so the script's unchanged
``init_process_group()`` and ``Checkpointer.from_env()`` work, and it goes through the set-up
the way a worker does: the model built, the optimizer made, its memory touched. At
:meth:`~elasticft.inprocess.worker.InProcess.run` it stops and waits (:func:`take_rank`),
before the training function. When a rank fails, the agent **assigns** the spare that rank
instead of starting a new process (:class:`~elasticft.inprocess.protocol.Assignment`: the failed
worker's environment and the new generation), and the spare

1. tears its private process group down,
2. takes the rank's identity: its environment (``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``,
   ``MASTER_*``, the agent's variables for that rank), its checkpoint memory (every
   :class:`~elasticft.ckpt.Checkpointer` of the process is **rebound**,
   :meth:`~elasticft.ckpt.Checkpointer.rebind`: closed and opened again for the rank, around the
   same optimizers) and its diagnostics recorders,
3. regroups on the generation's store like a survivor, and enters the function, which restores
   the rank's snapshot into memory the set-up has already touched.

What the script learns of its rank before :meth:`InProcess.run` is the spare's (0 of 1): a
script that runs under a spare reads its rank inside the function. Set-up that only a first
step would do (AdamW's state is made at the first ``optimizer.step()``) can be done by the
spare alone, where :func:`is_spare` says so; the restore overwrites what it changed.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from collections.abc import Mapping

import torch.distributed as dist

from elasticft.inprocess.groups import GroupOps, GroupSettings, regroup
from elasticft.inprocess.protocol import Assignment, InProcessSettings, SpareReady

logger = logging.getLogger(__name__)

SPARE_ENV = "ELASTICFT_INPROCESS_SPARE"
"""The spare's number on its node; set only in a spare that has not taken a rank."""
WORKER_ENV = frozenset({SPARE_ENV})
"""Worker variables the agent sets for the spare (listed in the agent's WORKER_ENV_NAMES)."""


def is_spare(env: Mapping[str, str] | None = None) -> bool:
    """Whether this process is a spare that has not taken a rank yet."""
    return bool((os.environ if env is None else env).get(SPARE_ENV))


def take_rank(settings: InProcessSettings, ops: GroupOps, poll_s: float = 0.005
              ) -> InProcessSettings:
    """Waits for the agent's assignment, then becomes that rank (see the module's docstring);
    returns the in-process settings of the rank. The agent ends a spare it no longer needs."""
    assert settings.directory is not None
    spare = os.environ[SPARE_ENV]
    from elasticft.ckpt.checkpointer import Checkpointer

    checkpointers = Checkpointer.instances()  # those the set-up made
    SpareReady(os.getpid(), time.time()).write(settings.directory, spare)
    logger.info("spare %s ready; waiting for a rank", spare)
    assignment = Assignment.read(settings.directory, spare)
    while assignment is None:
        time.sleep(poll_s)
        assignment = Assignment.read(settings.directory, spare)
    assigned = time.perf_counter()
    backend = str(dist.get_backend()) if dist.is_initialized() else "gloo"
    asked = GroupSettings.of_default_group()  # the script's timeout and options, for the rank's
    if dist.is_initialized():
        ops.destroy()
    os.environ.update(assignment.env)
    os.environ.pop(SPARE_ENV, None)
    rank = int(assignment.env["RANK"])
    world_size = int(assignment.env["WORLD_SIZE"])
    for checkpointer in checkpointers:
        checkpointer.rebind(os.environ, rank=rank, world_size=world_size)
    _arm_diagnostics()
    rebound_at = time.perf_counter()
    regroup(backend, rank, assignment.generation, settings.timeout_s, ops,
            dataclasses.replace(asked, device_id=None))  # its device: the rank's, not the spare's
    logger.warning("spare %s took rank %d (local rank %d) in generation %d in %.3f s (its own "
                   "group and %d checkpointer(s) rebound %.3f s, regroup %.3f s)", spare, rank,
                   assignment.local_rank, assignment.generation.generation,
                   time.perf_counter() - assigned, len(checkpointers), rebound_at - assigned,
                   time.perf_counter() - rebound_at)
    return InProcessSettings.from_env()


def _arm_diagnostics() -> None:
    """Installs the rank's diagnostics recorders, which a spare started without."""
    try:
        from elasticft.diag import autoinstall

        autoinstall.arm(os.environ)
    except Exception:  # diagnostics never stop training
        logger.warning("the spare could not arm the rank's diagnostics", exc_info=True)
