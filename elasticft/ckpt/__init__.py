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

Modules: ``api`` (tier base, errors), ``snapshot`` (state layout), ``shm`` (memory tier:
segments and a rank's slots) with ``slot`` (one slot file, mapped), ``slotformat`` (a slot's
header and seal) and ``slotmaker`` (slots made off the training thread), ``shards`` (DTensor
shards back into live DTensors), ``durable`` (disk/remote tiers, DCP-readable), ``peer`` (backup
over TCP), ``control`` ("checkpoint now"),
``checkpointer`` (worker side) with ``slotwriter`` (a save into a slot, on the copy thread),
``pipeline`` (the persist pipeline) and its two persisters, ``agentpersist`` (the agent's) and
``persister`` (a worker's own, without an agent); the agent side: ``service`` (the agent's
collaborator) with ``slots`` (the memory it owns), ``places`` (its directories), ``flush`` (the
flush on failure) and ``replicas`` (replica serving); ``commands`` (CLI).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from elasticft.lazy import lazy_getattr

if TYPE_CHECKING:
    from elasticft.ckpt.api import CheckpointError, StateMismatch
    from elasticft.ckpt.checkpointer import Checkpointer
    from elasticft.ckpt.settings import WorkerSettings
    from elasticft.ckpt.slotwriter import SaveRequest
    from elasticft.ckpt.state import StateCapture, capture, restore

__all__ = ["CheckpointError", "Checkpointer", "SaveRequest", "StateCapture", "StateMismatch",
           "WorkerSettings", "capture", "restore"]

__getattr__ = lazy_getattr(__name__, {
    "CheckpointError": "elasticft.ckpt.api",
    "StateMismatch": "elasticft.ckpt.api",
    "Checkpointer": "elasticft.ckpt.checkpointer",
    "SaveRequest": "elasticft.ckpt.slotwriter",
    "WorkerSettings": "elasticft.ckpt.settings",
    "capture": "elasticft.ckpt.state",
    "StateCapture": "elasticft.ckpt.state",
    "restore": "elasticft.ckpt.state",
})
