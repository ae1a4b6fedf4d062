"""elasticft's multi-tier asynchronous checkpoint engine.

Worker API::

    from elasticft.ckpt import Checkpointer, capture, restore

    ckpt = Checkpointer.from_env(optimizers=[optim])
    if (loaded := ckpt.load()) is not None:
        start, state = loaded
        extra = restore(state, model, optim)
    ...
    snapshot = StateCapture(model, optim)       # capture() made cheap for every step
    ckpt.save(step, snapshot(extra={"step": step}))   # returns at once

Where a snapshot goes, room by room:

* written: :mod:`elasticft.ckpt.memory` (the memory tier: shared-memory slots the agent owns,
  a worker's save copied into one off the training thread);
* persisted: :mod:`elasticft.ckpt.persisting` (the persist pipeline, the agent's and a
  worker's own persister, the failure flush, the disk tiers' format);
* backed up: :mod:`elasticft.ckpt.backup` (the peer tier and the replicas served from memory);
* restored: :mod:`elasticft.ckpt.restoring` (the loader over every tier, resharding, the
  state applied back into live tensors);
* checked: :mod:`elasticft.ckpt.integrity` (fingerprints compared for silent data corruption).

Beside the rooms: ``api`` (the tiers, :class:`~elasticft.ckpt.api.TierLevel`, and the errors),
``snapshot`` (a state's layout), ``hostcopy`` (bytes copied at memory speed), ``settings`` (a
worker's settings), ``control`` (the agent's "checkpoint now" channel to its workers),
``checkpointer`` (the worker's door: ``save``, ``load``, ``restore``), ``start_snapshot``
(the state training starts from, kept under in-process recovery), ``service`` (the agent's
door: its collaborator) and ``commands`` (``elasticft ckpt``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from elasticft.lazy import lazy_getattr

if TYPE_CHECKING:
    from elasticft.ckpt.api import CheckpointError, StateMismatch
    from elasticft.ckpt.checkpointer import Checkpointer
    from elasticft.ckpt.memory.slotwriter import SaveRequest
    from elasticft.ckpt.restoring.state import StateCapture, capture, restore
    from elasticft.ckpt.settings import WorkerSettings

__all__ = ["CheckpointError", "Checkpointer", "SaveRequest", "StateCapture", "StateMismatch",
           "WorkerSettings", "capture", "restore"]

__getattr__ = lazy_getattr(__name__, {
    "CheckpointError": "elasticft.ckpt.api",
    "StateMismatch": "elasticft.ckpt.api",
    "Checkpointer": "elasticft.ckpt.checkpointer",
    "SaveRequest": "elasticft.ckpt.memory.slotwriter",
    "WorkerSettings": "elasticft.ckpt.settings",
    "capture": "elasticft.ckpt.restoring.state",
    "StateCapture": "elasticft.ckpt.restoring.state",
    "restore": "elasticft.ckpt.restoring.state",
})
