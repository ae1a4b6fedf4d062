"""Persisting: where a snapshot goes from shared memory to disk, committed and kept.

* :mod:`~elasticft.ckpt.persisting.pipeline`: **where a snapshot is persisted**: the one
  pipeline both persisters run on a background thread: take it from its slot, write each rank's
  shard, commit the step once every rank's shard is durable.
* :mod:`~elasticft.ckpt.persisting.agentpersist`: the agent's persister: the step every local
  worker holds, written to the local and the remote directory and backed up to a peer.
* :mod:`~elasticft.ckpt.persisting.persister`: a worker's own persister, for a worker without
  an agent (plain ``torchrun``, one process).
* :mod:`~elasticft.ckpt.persisting.flush`: the flush on failure: the newest snapshot every
  local worker completed, written without delaying the decision or the restore.
* :mod:`~elasticft.ckpt.persisting.durable`: the disk tiers' format (``local`` and ``remote``):
  a step directory DCP reads, its commit marker, retention, and the tier a load reads.
* :mod:`~elasticft.ckpt.persisting.rejected`: steps rejected after silent data corruption,
  recorded in each place that keeps steps so that no load takes them again.
* :mod:`~elasticft.ckpt.persisting.diskfile`: files written atomically, with ``O_DIRECT``
  where it helps, checksummed on the way.
* :mod:`~elasticft.ckpt.persisting.places`: where a node's checkpoints and its control
  directory live.

Snapshots come from :mod:`elasticft.ckpt.memory`; a persisted step is restored by
:mod:`elasticft.ckpt.restoring` and backed up by :mod:`elasticft.ckpt.backup`.
"""
