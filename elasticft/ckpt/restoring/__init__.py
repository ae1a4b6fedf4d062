"""Restoring: where a snapshot comes back, from the fastest tier that holds it, into live tensors.

* :mod:`~elasticft.ckpt.restoring.loader`: **where a snapshot is restored from**: the newest
  step every rank holds, each rank from its fastest verified tier (memory, local, peer,
  remote: :class:`~elasticft.ckpt.api.TierLevel`), an older step when some rank cannot, or
  when a rank's newest is only another rank's replica, with that rank's RNG states.
* :mod:`~elasticft.ckpt.restoring.reassembly`: the ranks agreeing on a step, and the
  replicated items a deduplicated snapshot left to another rank fetched back.
* :mod:`~elasticft.ckpt.restoring.heal`: a rank that holds nothing (brought by a growth in
  process) healed from a data-parallel replica's memory, over the replicas' group.
* :mod:`~elasticft.ckpt.restoring.reshard`: a durable step written at another world size,
  read back with ``dcp.load``.
* :mod:`~elasticft.ckpt.restoring.state`: **where a snapshot is applied**: the training state
  built (``capture``, ``StateCapture``) and applied back (``restore``, ``LiveState``, which
  copies straight into the live tensors).
* :mod:`~elasticft.ckpt.restoring.loaders`: the data loaders given to ``StateCapture``: the
  RNG states each iterator was made with, so the one a mid-epoch resume makes again draws what
  the epoch's first one drew.
* :mod:`~elasticft.ckpt.restoring.shards`: a stored DTensor shard put back into the live
  DTensor of the same name, mesh and placements.

``Checkpointer.load`` and ``Checkpointer.restore`` (:mod:`elasticft.ckpt.checkpointer`) are
the worker's doors into this package.
"""
