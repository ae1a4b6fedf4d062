"""Recovery: what happens after a failure, in two forms.

**Hierarchical recovery** (the agent's, across nodes): just-in-time checkpoints of the healthy
replicas, counting offences, eviction and blacklisting, coordinated through the rendezvous round.
:mod:`~elasticft.recovery.orchestrator` is the agent collaborator; ``roster`` (who is alive,
waiting or banned) and ``roundstore`` (the round's keys between agents) serve it.

**In-process recovery** (the worker's, ``--recovery-inprocess``): a survivor of a peer's failure
keeps its process, regroups with the failed rank's replacement and re-enters its training
function (:mod:`~elasticft.recovery.inprocess`, ``InProcess.run``); a pre-started spare can take
the failed rank instead of a new process (:mod:`~elasticft.recovery.spare`). With them: the
records and settings shared with the agent (``protocol``), the process groups' teardown and
regroup (``groups``), the interrupt of a blocked survivor (``interrupt``), the device's fitness
to rejoin (``health``) and NCCL's environment (``ncclenv``). The agent's side of it is
:mod:`elasticft.agent.inprocess_recovery`.
"""
