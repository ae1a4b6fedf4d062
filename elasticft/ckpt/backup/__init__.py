"""The peer tier: a node's snapshots held by another node, for when the node itself is lost.

* :mod:`~elasticft.ckpt.backup.peer`: each node's persisted shards pushed to a backup node's
  agent over an authenticated TCP connection, where to place them, and the tier a load asks.
* :mod:`~elasticft.ckpt.backup.replicas`: the data-parallel replicas a node holds in memory,
  served to the node that replaces a lost one (newer than any step on disk).

The shards come from :mod:`elasticft.ckpt.persisting`; :mod:`elasticft.ckpt.restoring.loader`
reads them back.
"""
