"""In-process recovery (``InProcess().run(train)`` under ``elasticft-run``): a peer's failure
costs the survivors a roll-back, not their process.

A survivor keeps its process, tears down its process groups, regroups with the failed rank's
replacement on the agent's next *generation* and re-enters its training function, which restores
the newest step every rank holds from memory. The package holds both halves and what they share:

**The worker's half** (imported by the training script, ``from elasticft.inprocess import
InProcess``):

- ``worker``: :class:`InProcess`, the loop that re-enters the function (``run`` for one
  call), and the judge of a peer's failure (``peer_failure``);
- ``interrupt``: the monitor that interrupts a survivor blocked in a collective
  (:class:`PeerInterrupted`) and the commit gate of a step that ended after its generation;
- ``groups``: the process groups' teardown and regroup (:class:`GroupOps`, the seam tests replace);
- ``meshes``: the sharded modules (FSDP2, tensor parallel) a survivor keeps (:class:`KeptModules`);
- ``device``: whether a survivor's device is fit to rejoin; ``ncclenv``: NCCL's environment;
- ``cuda_graphs``: the CUDA graphs a survivor drops before its groups' abort
  (:func:`drop_on_failure`);
- ``spare``: a pre-started process that takes a failed rank (:func:`take_rank`).

**The agent's half** (held by the agent, :class:`elasticft.inprocess.agent_side.InProcessRecovery`):

- ``agent_side``: the recovery as the agent carries it out, and what it decides with;
- ``ports``: what it needs of the agent (:class:`~elasticft.inprocess.ports.AgentSide`) and of
  the node's worker processes (:class:`~elasticft.inprocess.ports.WorkerOps`), which the agent
  implements and passes in: this package imports nothing of ``elasticft.agent``;
- ``generations``: the generations the agent publishes and the workers' records it reads;
  ``recovery_timing``: a recovery's phases and each survivor's limits;
- ``across_nodes``, ``failure_news``, ``reshape``: the agreement of several nodes' agents on the
  next generation, the news of an ended one, and whether a new round's layout goes on in process;
- ``spare_keeper`` and ``placement``: the agent's spare and which GPU a replacement starts on.

**Between the halves**: ``protocol``, the records and settings the agent and its workers write
for each other.

The package sits on one layer (``tests/test_layers.py``): above the subsystems, whose worker APIs
a survivor rebinds, below the framework integrations and the agent. Its names are lazy, so
``import elasticft.inprocess`` stays light.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from elasticft.lazy import lazy_getattr

if TYPE_CHECKING:
    from elasticft.inprocess.cuda_graphs import drop_on_failure
    from elasticft.inprocess.groups import GroupOps
    from elasticft.inprocess.interrupt import PeerInterrupted
    from elasticft.inprocess.meshes import KeptModules
    from elasticft.inprocess.spare import take_rank
    from elasticft.inprocess.worker import InProcess, peer_failure, run

__all__ = ["GroupOps", "InProcess", "KeptModules", "PeerInterrupted", "drop_on_failure",
           "peer_failure", "run", "take_rank"]

__getattr__ = lazy_getattr(__name__, {
    "InProcess": "elasticft.inprocess.worker",
    "peer_failure": "elasticft.inprocess.worker",
    "run": "elasticft.inprocess.worker",
    "PeerInterrupted": "elasticft.inprocess.interrupt",
    "GroupOps": "elasticft.inprocess.groups",
    "KeptModules": "elasticft.inprocess.meshes",
    "take_rank": "elasticft.inprocess.spare",
    "drop_on_failure": "elasticft.inprocess.cuda_graphs",
})
