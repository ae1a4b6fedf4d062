"""Hierarchical recovery: the agent's recovery across nodes, through the rendezvous round.

After a failure the healthy replicas take a just-in-time checkpoint, offences are counted, and a
node that keeps failing is evicted and blacklisted; the agents coordinate it through the
rendezvous round. :mod:`~elasticft.recovery.orchestrator` is the agent collaborator; ``roster``
(who is alive, waiting or banned) serves it, with the round's keys between agents in
:mod:`elasticft.rendezvous.roundstore`.

In-process recovery, where a survivor keeps its process and regroups, is its own package:
:mod:`elasticft.inprocess`.
"""
