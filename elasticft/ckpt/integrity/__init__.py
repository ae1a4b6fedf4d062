"""Silent data corruption, found in the snapshots the memory tier already holds.

* :mod:`~elasticft.ckpt.integrity.fingerprint`: a digest of the replicated state a rank's
  snapshot holds, read by the agent from the slot.
* :mod:`~elasticft.ckpt.integrity.sdc`: which rank diverged from its replica set, a pure
  function over one step's fingerprints.
* :mod:`~elasticft.ckpt.integrity.sdcwatch`: the agent's watch that fingerprints, gathers and
  compares them, and logs what it finds.
* :mod:`~elasticft.ckpt.integrity.nodehealth`: a node's health, the evidence that settles a
  split between two replicas on two nodes.
"""
