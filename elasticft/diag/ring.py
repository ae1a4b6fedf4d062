"""The per-rank progress ring: one fixed-layout record stream in shared memory per producer.

Every worker has up to two producers: the NCCL shim (C, :file:`shim/` (ring.c)) and the Python
recorder (:mod:`elasticft.diag.recorder`, gloo collectives, DDP buckets, step marks, losses).
Each writes its own ring, so the two never need a lock between languages. The agent maps the
rings read-only and polls them (:class:`RingReader`); a ring costs a few hundred kilobytes.

Where a worker finds its rings (:class:`RingFiles`): under an agent, files that have no name.
The agent creates each ring as an anonymous file (:func:`create_anonymous_ring`: ``O_TMPFILE``
on ``/dev/shm``, or a ``memfd``), keeps its descriptor, and names it to the worker as
``/proc/<agent pid>/fd/<n>``, which the worker opens at start. The memory goes with the last
descriptor or mapping, whoever holds it and however it dies: a SIGKILLed agent and its workers
leave nothing in ``/dev/shm``. Run by hand (benchmarks, tests), a worker is given a directory
instead and creates ``rank-<global rank>.<source>.ring`` in it.

Layout (little-endian, the C shim declares the same structs)::

    header (128 bytes)
      0  u32 magic 'EFTR'     4 u32 version     8 u32 capacity     12 u32 record size
     16  i32 pid             20 i32 rank       24 u64 head (seq of the newest published record)
     32  u64 heartbeat_ns (producer's background thread, CLOCK_MONOTONIC)
     40  u64 flags (bit 0: completions are timed)
     48  u64 last step number 56 u64 monotonic time of the last step mark
     64  char source[16]
    record (64 bytes), slot = (seq - 1) % capacity
      0  u64 seq   8 u64 comm key   16 u64 bytes   24 u64 enqueue_ns
     32  u64 complete_ns (0: in flight)
     40  f64 value (loss, step number, or GPU milliseconds)   48 u32 op   52 i32 peer/root
     56  u32 flags (bit 0 timed, bit 1 host-side completion, bits 8-15 NCCL result)
     60  u32 comm_seq (the call's number within its communicator)

A writer publishes a record by zeroing ``seq``, writing the fields, then storing ``seq``; a reader
accepts a slot only when ``seq`` reads the same expected value before and after copying it.
The *comm key* is the same number on every member of a communicator (a hash of the NCCL unique
id, or of the process group's name), so ranks can be compared by ``(comm key, comm_seq)``.
Times are CLOCK_MONOTONIC nanoseconds, comparable between processes of one node.
"""

from __future__ import annotations

import dataclasses
import enum
import errno
import logging
import mmap
import os
import struct
from collections.abc import Mapping
from pathlib import Path

from elasticft.unnamed import anonymous_file

MAGIC = 0x52544645  # b"EFTR" little-endian
VERSION = 1
HEADER_SIZE = 128
RECORD_SIZE = 64
DEFAULT_CAPACITY = 4096

_HEADER = struct.Struct("<IIIIiiQQQQQ16s")
_RECORD = struct.Struct("<QQQQQdIiII")
_U64 = struct.Struct("<Q")
_U64X2 = struct.Struct("<QQ")
_HEAD_OFFSET = 24
_HEARTBEAT_OFFSET = 32
_STEP_OFFSET = 48
assert _HEADER.size == 80 and _RECORD.size == RECORD_SIZE

RING_DIR_ENV = "ELASTICFT_DIAG_RING_DIR"
"""A directory where the worker creates its named rings (a worker run by hand)."""
PY_RING_ENV = "ELASTICFT_DIAG_PY_RING"
NCCL_RING_ENV = "ELASTICFT_DIAG_NCCL_RING"
NCCL_STATUS_ENV = "ELASTICFT_DIAG_NCCL_STATUS"
"""The worker's own files, as the agent names them (``/proc/<agent pid>/fd/<n>``)."""
FILE_ENV_NAMES = (PY_RING_ENV, NCCL_RING_ENV, NCCL_STATUS_ENV)

FLAG_TIMED = 1
FLAG_HOST_COMPLETION = 2
RING_FLAG_TIMED = 1

logger = logging.getLogger(__name__)


class RingUnavailable(OSError):
    """The ring's pages cannot be reserved (a full /dev/shm): that ring records nothing."""


def reserve_pages(fd: int, size: int, path: Path) -> None:
    """Backs every page of the ring file now: a store into an unbacked page of a full tmpfs
    raises SIGBUS, which would kill the process that maps it. File systems without fallocate
    back pages on write as before (the same rule as the C shim's ring.c)."""
    try:
        os.posix_fallocate(fd, 0, size)
    except OSError as e:
        if e.errno in (errno.EOPNOTSUPP, errno.EINVAL):
            return
        raise RingUnavailable(e.errno, f"diagnostics ring {path} cannot reserve {size} bytes "
                                       f"({e.strerror}); free /dev/shm or lower "
                                       "diag_ring_capacity") from None


class Op(enum.IntEnum):
    """What a record is; NCCL and Python producers share the collective numbers."""

    ALL_REDUCE = 1
    BROADCAST = 2
    REDUCE = 3
    ALL_GATHER = 4
    REDUCE_SCATTER = 5
    ALL_TO_ALL = 6
    SEND = 7
    RECV = 8
    COMM_INIT = 10
    COMM_ABORT = 11
    COMM_DESTROY = 12
    BARRIER = 13
    GATHER = 14
    SCATTER = 15
    DDP_BUCKET = 16
    STEP = 20
    LOSS = 21


def ring_size(capacity: int) -> int:
    return HEADER_SIZE + capacity * RECORD_SIZE


def ring_path(directory: Path, rank: int, source: str) -> Path:
    return Path(directory) / f"rank-{rank}.{source}.ring"


@dataclasses.dataclass(frozen=True)
class RingFiles:
    """Where one worker's diagnostics files are: its two rings and its NCCL shim status file
    (:mod:`elasticft.diag.shimcheck`). None: that file is not kept."""

    py: Path | None
    nccl: Path | None
    status: Path | None

    @classmethod
    def in_dir(cls, directory: Path, rank: int) -> RingFiles:
        """The named layout of a worker run by hand: ``rank-<rank>.{py,nccl}.ring`` and
        ``rank-<rank>.nccl.status`` in ``directory``."""
        directory = Path(directory)
        return cls(ring_path(directory, rank, "py"), ring_path(directory, rank, "nccl"),
                   directory / f"rank-{rank}.nccl.status")

    @classmethod
    def from_env(cls, env: Mapping[str, str], rank: int) -> RingFiles | None:
        """This worker's files as its environment names them; None without diagnostics."""
        if any(env.get(name) for name in FILE_ENV_NAMES):
            py, nccl, status = (Path(env[n]) if env.get(n) else None for n in FILE_ENV_NAMES)
            return cls(py, nccl, status)
        if env.get(RING_DIR_ENV):
            return cls.in_dir(Path(env[RING_DIR_ENV]), rank)
        return None

    def to_env(self) -> dict[str, str]:
        return {name: str(path) for name, path in zip(FILE_ENV_NAMES, (self.py, self.nccl,
                                                                        self.status), strict=True)
                if path is not None}


def _init_ring(fd: int, path: Path, rank: int, source: str, capacity: int) -> bool:
    size = ring_size(capacity)
    os.ftruncate(fd, size)
    try:
        reserve_pages(fd, size, path)
    except RingUnavailable as e:
        logger.warning("%s; rank %d records no %s diagnostics", e.strerror, rank, source)
        return False
    with mmap.mmap(fd, size) as m:
        _HEADER.pack_into(m, 0, MAGIC, VERSION, capacity, RECORD_SIZE, 0, rank, 0, 0, 0, 0, 0,
                          source.encode()[:16])
    return True


def create_anonymous_ring(directory: Path, rank: int, source: str,
                          capacity: int = DEFAULT_CAPACITY) -> int | None:
    """A ring with an empty header and its pages reserved, as an :func:`anonymous_file`: its
    open descriptor, or None, after one warning line, when its pages cannot be reserved (that
    ring records nothing while training goes on)."""
    fd = anonymous_file(directory)
    try:
        if _init_ring(fd, directory / f"rank-{rank}.{source}.ring", rank, source, capacity):
            return fd
    except BaseException:
        os.close(fd)
        raise
    os.close(fd)
    return None


@dataclasses.dataclass(frozen=True)
class Record:
    """One record of a ring, its fields in the layout's order (see the module docstring)."""

    seq: int
    comm: int
    nbytes: int
    enqueue_ns: int
    complete_ns: int
    value: float
    op: int
    peer: int
    flags: int
    comm_seq: int

    @property
    def in_flight(self) -> bool:
        return self.complete_ns == 0

    @property
    def op_name(self) -> str:
        try:
            return Op(self.op).name.lower()
        except ValueError:
            return f"op{self.op}"

    def duration_s(self, now_ns: int) -> float:
        return ((self.complete_ns or now_ns) - self.enqueue_ns) / 1e9


@dataclasses.dataclass(frozen=True)
class RingHeader:
    capacity: int
    pid: int
    rank: int
    head: int
    heartbeat_ns: int
    flags: int
    step: int
    step_ns: int
    source: str


class RingWriter:
    """Appends records to one ring (the Python producer; not thread-safe, callers lock).

    Raises :class:`RingUnavailable` when the ring's pages cannot be reserved.
    """

    def __init__(self, path: Path, rank: int, source: str = "py",
                 capacity: int = DEFAULT_CAPACITY) -> None:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            size = os.fstat(fd).st_size
            created = size < HEADER_SIZE
            if created:
                os.ftruncate(fd, ring_size(capacity))
                size = ring_size(capacity)
            try:
                reserve_pages(fd, size, path)
            except RingUnavailable:
                if created:
                    os.unlink(path)
                raise
            self._map = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        magic, _, cap, rsize, *_ = _HEADER.unpack_from(self._map, 0)
        if magic != MAGIC or rsize != RECORD_SIZE or ring_size(cap) > size:
            cap = (size - HEADER_SIZE) // RECORD_SIZE
        self.capacity = cap
        self._seq = 0
        _HEADER.pack_into(self._map, 0, MAGIC, VERSION, cap, RECORD_SIZE, os.getpid(), rank, 0,
                          0, 0, 0, 0, source.encode()[:16])

    def append(self, op: int, *, comm: int = 0, nbytes: int = 0, enqueue_ns: int,
               complete_ns: int = 0, value: float = 0.0, peer: int = -1, flags: int = 0,
               comm_seq: int = 0) -> int:
        """Publishes a record and returns its seq (the handle for :meth:`complete`)."""
        return self.publish(op, comm, nbytes, enqueue_ns, complete_ns, value, peer, flags,
                            comm_seq)

    def publish(self, op: int, comm: int, nbytes: int, enqueue_ns: int, complete_ns: int,
                value: float, peer: int, flags: int, comm_seq: int) -> int:
        """:meth:`append` with positional arguments (the recorder's hot path)."""
        self._seq = seq = self._seq + 1
        offset = HEADER_SIZE + ((seq - 1) % self.capacity) * RECORD_SIZE
        m = self._map
        # pack_into writes the fields in order, so seq reads 0 until the final store below.
        _RECORD.pack_into(m, offset, 0, comm, nbytes, enqueue_ns, complete_ns, value, op, peer,
                          flags, comm_seq)
        _U64.pack_into(m, offset, seq)
        _U64.pack_into(m, _HEAD_OFFSET, seq)
        return seq

    def complete(self, seq: int, complete_ns: int) -> None:
        offset = HEADER_SIZE + ((seq - 1) % self.capacity) * RECORD_SIZE
        # The slot may have been reused by a newer record once the ring wrapped.
        if _U64.unpack_from(self._map, offset)[0] == seq:
            _U64.pack_into(self._map, offset + 32, complete_ns)

    def heartbeat(self, now_ns: int, timed: bool = True) -> None:
        _U64X2.pack_into(self._map, _HEARTBEAT_OFFSET, now_ns, RING_FLAG_TIMED if timed else 0)

    def mark_step(self, step: int, now_ns: int) -> None:
        _U64X2.pack_into(self._map, _STEP_OFFSET, step, now_ns)

    def close(self) -> None:
        self._map.close()


class RingReader:
    """Reads one ring incrementally; tolerates a ring that is not written yet."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self._map: mmap.mmap | None = None
        self._next_seq = 1

    def _mapped(self) -> mmap.mmap | None:
        if self._map is None:
            try:
                fd = os.open(self.path, os.O_RDONLY)
            except OSError:
                return None
            try:
                size = os.fstat(fd).st_size
                if size < HEADER_SIZE:
                    return None
                self._map = mmap.mmap(fd, size, prot=mmap.PROT_READ)
            finally:
                os.close(fd)
        return self._map

    def header(self) -> RingHeader | None:
        m = self._mapped()
        if m is None:
            return None
        (magic, _v, cap, rsize, pid, rank, head, hb, flags, step, step_ns,
         source) = _HEADER.unpack_from(m, 0)
        if magic != MAGIC or rsize != RECORD_SIZE or ring_size(cap) > len(m):
            return None
        return RingHeader(cap, pid, rank, head, hb, flags, step, step_ns,
                          source.rstrip(b"\0").decode(errors="replace"))

    def read_slot(self, seq: int, capacity: int) -> Record | None:
        m = self._map
        if m is None:
            return None
        offset = HEADER_SIZE + ((seq - 1) % capacity) * RECORD_SIZE
        fields = _RECORD.unpack_from(m, offset)
        if fields[0] != seq or _U64.unpack_from(m, offset)[0] != seq:
            return None
        return Record(*fields)

    def poll(self) -> tuple[RingHeader | None, list[Record]]:
        """The header and every record published since the previous poll (oldest first)."""
        header = self.header()
        if header is None or header.head < self._next_seq:
            return header, []
        first = max(self._next_seq, header.head - header.capacity + 1, 1)
        records = [r for seq in range(first, header.head + 1)
                   if (r := self.read_slot(seq, header.capacity)) is not None]
        self._next_seq = header.head + 1
        return header, records

    def close(self) -> None:
        if self._map is not None:
            self._map.close()
            self._map = None
