"""The memory tier: where a snapshot is written, into shared-memory slots on this host.

A *slot* is one file in ``/dev/shm`` holding at most one rank's snapshot; every local rank has
a few, so a complete snapshot is never overwritten by the next one. The agent owns them, so
they outlive a crashed worker.

* :mod:`~elasticft.ckpt.memory.slotformat`: a slot's layout (header, manifest, payload) and the
  seal that marks a snapshot whole.
* :mod:`~elasticft.ckpt.memory.slot`: one slot file, mapped: made, grown, locked, read.
* :mod:`~elasticft.ckpt.memory.slotmaker`: slots made and grown off the training thread.
* :mod:`~elasticft.ckpt.memory.shm`: the memory tier itself: a rank's set of slots
  (:class:`~elasticft.ckpt.memory.shm.SlotSet`), which one a writer or a reader takes, and the
  tier a load reads first.
* :mod:`~elasticft.ckpt.memory.slotwriter`: **where a snapshot is written**: a worker's save,
  copied into a free slot in two parts, the second on a copy thread.
* :mod:`~elasticft.ckpt.memory.device`: the CUDA path of that copy (pinned slots, a copy
  stream ordered by events, optional device staging).
* :mod:`~elasticft.ckpt.memory.nodeslots`: the agent's side: every local worker's slots, held
  for the job's life, and which steps they all hold complete.

From here a snapshot is persisted by :mod:`elasticft.ckpt.persisting` and restored by
:mod:`elasticft.ckpt.restoring`.
"""
