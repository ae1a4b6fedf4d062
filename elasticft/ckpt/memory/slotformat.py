"""The slot file's format: a header, the manifest, the payload, and the seal that marks it whole.

A slot (:class:`elasticft.ckpt.memory.slot.Slot`) is one file holding at most one rank's snapshot:

* a 4 KiB header (:class:`SlotHeader`): its state, a generation that grows with every
  snapshot written, the step, rank and world size it was taken as, where the manifest and the
  payload lie, and the seal;
* the manifest (JSON, :mod:`elasticft.ckpt.snapshot`), at :data:`HEADER_BYTES`;
* the payload, the tensors' raw bytes, at the header's ``payload_offset``.

The writer holds an exclusive ``flock`` on the slot for the whole write and marks the header
``WRITING`` first and ``COMPLETE`` (with a new generation and the seal) last; a reader holds a
shared ``flock``. A crash mid-write releases the lock and leaves ``WRITING`` behind, so a torn
slot is never mistaken for a snapshot. The seal (:func:`seal_of`) catches what the lock
cannot: a complete snapshot overwritten afterwards.
"""

from __future__ import annotations

import dataclasses
import struct
import zlib
from collections.abc import Iterable, Mapping
from typing import Any

import numpy

HEADER_BYTES = 4096
"""Room for the header at a slot's start; the manifest follows it."""
_MAGIC = b"EFTSNAP1"
# magic, version, state, generation, step, rank, world, manifest_len, payload_off, payload_len,
# seal_kind, seal, completed_at
_HEADER = struct.Struct("<8sIIQqiiQQQII d")
EMPTY, WRITING, COMPLETE = 0, 1, 2
SEAL_NONE, SEAL_SAMPLED = 0, 2
"""``seal_kind``: no seal, or :func:`seal_of` (1, a CRC-32 of every payload byte, is retired)."""
SEAL_STRIDE = 64 * 1024
SEAL_SAMPLE = 32
_SEALED_FIELDS = struct.Struct("<QqiiQQQ")
PACKED_HEADER_BYTES = _HEADER.size
"""The bytes of a packed :class:`SlotHeader`."""


@dataclasses.dataclass(frozen=True)
class SlotHeader:
    state: int
    generation: int
    step: int
    rank: int
    world_size: int
    manifest_len: int
    payload_offset: int
    payload_len: int
    seal_kind: int
    seal: int
    completed_at: float

    @classmethod
    def parse(cls, raw: bytes) -> SlotHeader | None:
        if len(raw) < _HEADER.size:
            return None
        fields = _HEADER.unpack_from(raw)
        if fields[0] != _MAGIC:
            return None
        return cls(*fields[2:])

    def pack(self) -> bytes:
        return _HEADER.pack(
            _MAGIC, 1, self.state, self.generation, self.step, self.rank, self.world_size,
            self.manifest_len, self.payload_offset, self.payload_len, self.seal_kind, self.seal,
            self.completed_at,
        )


def seal_of(header: SlotHeader, manifest: Any, payload: Any,
            item_offsets: Iterable[int]) -> int:
    """A cheap integrity mark of a complete snapshot, written by the writer with ``COMPLETE``.

    CRC-32 of the header's placement fields, the whole manifest, and ``SEAL_SAMPLE`` bytes at
    the start of every tensor item (``item_offsets``) and of every ``SEAL_STRIDE`` bytes of the
    payload: a few thousand samples, about 2 ms where a CRC of every byte cost as much as the
    restore's copy (sampling every 4 KiB page cost 40-50 ms here: a TLB miss per page). Torn
    writes are already excluded by the header state under the writer's lock; what the seal
    catches is a complete snapshot overwritten afterwards in bulk (training state aliasing the
    snapshot, a stray writer): any tensor rewritten from its start, or any run of 64 KiB. A
    single flipped bit between samples passes; the durable tiers keep a CRC-32 of every byte.
    """
    crc = zlib.crc32(_SEALED_FIELDS.pack(
        header.generation, header.step, header.rank, header.world_size, header.manifest_len,
        header.payload_offset, header.payload_len))
    crc = zlib.crc32(manifest, crc)
    data = memoryview(payload).cast("B")
    if not len(data):
        return crc
    starts = numpy.array(sorted({*range(0, len(data), SEAL_STRIDE),
                                 *(o for o in item_offsets if 0 <= o < len(data))}),
                         dtype=numpy.int64)
    # numpy, not torch: a gather this small must not wake torch's intra-op thread pool.
    index = numpy.minimum(numpy.add.outer(starts, numpy.arange(SEAL_SAMPLE)).ravel(),
                          len(data) - 1)
    return zlib.crc32(numpy.frombuffer(data, dtype=numpy.uint8).take(index), crc)


def item_offsets(manifest: Mapping[str, Any]) -> list[int]:
    """Payload offsets of the tensor items a snapshot stores itself (sampled by the seal)."""
    return [int(item["offset"]) for item in manifest["items"]
            if item["kind"] == "tensor" and "offset" in item]
