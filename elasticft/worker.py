"""The worker API: what a training script may call to cooperate with the elasticft agent.

Scripts run unmodified under ``elasticft-run``; calling :func:`init` adds what the agent cannot
see from outside::

    import elasticft
    diag = elasticft.init(model=ddp_model)
    for step in ...:
        loss = ...
        diag.report_loss(loss)        # NaN/inf and loss-spike detection

Outside ``elasticft-run`` (no agent environment) every call is a no-op, so the same script still
runs under plain ``torchrun`` or ``python``.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from typing import Any

from elasticft.diag import shimcheck
from elasticft.diag.recorder import Recorder, install, installed
from elasticft.diag.ring import RingFiles, RingUnavailable

logger = logging.getLogger(__name__)


class Diagnostics:
    """The handle :func:`init` returns; methods do nothing when no agent is watching."""

    def __init__(self, recorder: Recorder | None) -> None:
        self.recorder = recorder

    @property
    def active(self) -> bool:
        return self.recorder is not None

    def report_loss(self, loss: Any, step: int | None = None) -> None:
        if self.recorder is not None:
            self.recorder.report_loss(loss, step)

    def mark_step(self) -> None:
        """Marks a step for loops without a torch optimizer (steps are marked automatically at
        every ``optimizer.step()``)."""
        if self.recorder is not None:
            self.recorder.mark_step()

    def watch(self, model: Any) -> None:
        """Times a DistributedDataParallel model's gradient buckets (call before training)."""
        if self.recorder is not None:
            self.recorder.attach_ddp(model)


def init(model: Any = None, *, env: Mapping[str, str] | None = None) -> Diagnostics:
    """Connects this worker to the agent's diagnostics; returns a :class:`Diagnostics` handle.

    Installs the recorder unless the agent's bootstrap already did (idempotent), and times
    ``model``'s gradient buckets when it is a DistributedDataParallel model.
    """
    env = os.environ if env is None else env
    recorder = installed()
    rank = int(env.get("RANK", "0"))
    files = RingFiles.from_env(env, rank)
    if recorder is None and files is not None:
        shim = shimcheck.report(files.status, rank, env)
        try:
            # No Python ring: the agent could not reserve one, and said so.
            if files.py is not None:
                recorder = install(files.py, rank)
                recorder.nccl_check = shimcheck.interception_check(files.status, rank, shim)
        except RingUnavailable as e:
            logger.warning("%s; rank %s records no Python diagnostics", e.strerror,
                           env.get("RANK", "0"))
        except Exception:
            logger.warning("elasticft diagnostics unavailable in this worker", exc_info=True)
    handle = Diagnostics(recorder)
    if model is not None:
        handle.watch(model)
    return handle
