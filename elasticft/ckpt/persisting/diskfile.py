"""Checkpoint files on disk: written atomically, from the caller's memory, checksummed on the way.

* :func:`written_atomically`: a file written under a temporary name, fsynced and renamed, so a
  crash leaves either nothing or the whole file; a full disk is one :class:`StorageFull` line.
* :class:`DirectFile`: a new file written with ``O_DIRECT``, so the disk reads a snapshot's
  tensors in place, with no copy into the page cache; :func:`padding_before` places a tensor's
  blob so that its bytes can go that way.
* :class:`ShardStream`: the stream ``torch.save`` writes a blob through, keeping its CRC-32
  (zlib-ng's where installed: the same values as zlib's, 3-4x faster) and its length.
* :func:`background_priority`: writers run at nice 19, on CPU that training leaves idle.

:mod:`elasticft.ckpt.persisting.durable` lays out and commits checkpoints with these.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import logging
import mmap
import os
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import torch

from elasticft.ckpt.api import StorageFull

try:  # zlib-ng's CRC-32 (carry-less multiply): the same values at 3-4x zlib's speed
    from zlib_ng.zlib_ng import crc32
except ImportError:  # no wheel for this platform: the same checksum at zlib's speed
    from zlib import crc32

logger = logging.getLogger(__name__)


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def disk_error(e: OSError, path: Path) -> Exception:
    if e.errno in (errno.ENOSPC, errno.EDQUOT):
        return StorageFull(
            f"no space left writing {path}; free space there or point the checkpoint "
            "directory elsewhere (training continues on the memory tier)"
        )
    return e


@contextlib.contextmanager
def written_atomically(path: Path, direct: bool = False) -> Iterator[Any]:
    """A file to write ``path`` through: written under a temporary name, then fsynced and
    renamed once the block ends, so a crash leaves either nothing or the whole file. A disk error
    removes the temporary file and is raised as one line naming the fix.

    ``direct``: a :class:`DirectFile` where the filesystem takes ``O_DIRECT``, else a buffered
    file (tmpfs before Linux 6.6, some network filesystems, a device such as ``/dev/full``)."""
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        with open_new(tmp, direct) as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as e:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise disk_error(e, path) from None
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise


def atomic_write(path: Path, data: bytes | bytearray | memoryview) -> None:
    with written_atomically(path) as f:
        f.write(data)


def open_new(path: Path, direct: bool) -> Any:
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC
    if direct and hasattr(os, "O_DIRECT"):
        try:
            return DirectFile(os.open(path, flags | os.O_DIRECT, 0o600))
        except OSError as e:
            if e.errno != errno.EINVAL:
                raise
    return open(path, "wb", opener=lambda p, f: os.open(p, f, 0o600))


_BLOCK = 4096
"""The alignment ``O_DIRECT`` asks of file offsets, lengths and memory: a page, which every
Linux block device's logical block divides."""

DIRECT_MIN = 1 << 20
"""A write at least this large, congruent with its file offset, goes to the disk from the
caller's memory; anything smaller is gathered in the bounce buffer."""


class DirectRefused(Exception):
    """The filesystem opened a file with ``O_DIRECT`` but refused an aligned write to it."""


def _write_all(fd: int, view: memoryview) -> None:
    while view:
        try:
            written = os.write(fd, view)
        except OSError as e:
            if e.errno == errno.EINVAL:
                raise DirectRefused(str(e)) from None
            raise
        if written <= 0:
            raise OSError(errno.EIO, "the disk took no bytes")
        view = view[written:]


def _address(view: memoryview) -> int:
    return int(np.frombuffer(view, dtype=np.uint8).ctypes.data) if len(view) else 0


class DirectFile:
    """A new file written with ``O_DIRECT``: the disk reads large writes from the caller's memory.

    A buffered write copies every byte into the page cache, and the kernel writes it back later:
    a second pass over the snapshot through the CPU and its caches, beside training. Here a
    write of at least :data:`DIRECT_MIN` bytes whose address is congruent with its file offset
    modulo :data:`_BLOCK` (the shard writer pads before a tensor's blob to make it so) goes to
    the disk as it is, its unaligned head and tail through a page-aligned bounce buffer; any
    other write is gathered in the bounce buffer and written a whole number of blocks at a time.
    Invariant: the kernel's file offset is ``position - held``, a multiple of :data:`_BLOCK`.
    """

    def __init__(self, fd: int, bounce_bytes: int = 4 << 20) -> None:
        self._fd = fd
        self._bounce = mmap.mmap(-1, bounce_bytes)  # anonymous: page-aligned
        self._view = memoryview(self._bounce)
        self._held = 0
        self._position = 0
        self.bytes_direct = 0
        """Bytes the disk took from the caller's memory, past the bounce buffer."""

    def fileno(self) -> int:
        return self._fd

    def tell(self) -> int:
        return self._position

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        size = len(view)
        if size >= DIRECT_MIN and (_address(view) - self._position) % _BLOCK == 0:
            head = -self._position % _BLOCK
            self._gather(view[:head])  # completes a block: the bounce holds whole blocks
            self._drain()
            body = (size - head) // _BLOCK * _BLOCK
            _write_all(self._fd, view[head : head + body])
            self._position += body
            self.bytes_direct += body
            self._gather(view[head + body :])
        else:
            self._gather(view)
        return size

    def flush(self) -> None:
        """Puts every byte written so far in the file: the last partial block padded, then the
        file cut to its length; the offset goes back to that block for the next write."""
        self._drain()
        if self._held:
            padded = self._held + -self._held % _BLOCK
            self._view[self._held : padded] = bytes(padded - self._held)
            _write_all(self._fd, self._view[:padded])
            os.lseek(self._fd, self._position - self._held, os.SEEK_SET)
        os.ftruncate(self._fd, self._position)

    def close(self) -> None:
        if self._fd < 0:
            return
        os.close(self._fd)
        self._fd = -1
        # A slice of the bounce buffer may outlive a failed write (in its traceback); the
        # mapping then goes with the last reference instead.
        with contextlib.suppress(BufferError):
            self._view.release()
            self._bounce.close()

    def __enter__(self) -> DirectFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _gather(self, view: memoryview) -> None:
        while view:
            take = min(len(view), len(self._bounce) - self._held)
            self._view[self._held : self._held + take] = view[:take]
            self._held += take
            self._position += take
            view = view[take:]
            if self._held == len(self._bounce):
                self._drain()

    def _drain(self) -> None:
        """Writes the bounce buffer's whole blocks and keeps its partial last one."""
        whole = self._held // _BLOCK * _BLOCK
        if whole:
            _write_all(self._fd, self._view[:whole])
            rest = self._held - whole
            self._view[:rest] = self._view[whole : self._held]
            self._held = rest


def background_priority(niceness: int = 19) -> None:
    """Lowers the calling thread's CPU priority (Linux threads have their own nice value).

    Persisting competes with training for the CPU; at nice 19 it takes what training leaves
    (waits in collectives, data loading) instead of slowing the steps down.
    """
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), niceness)
    except (OSError, AttributeError):
        logger.debug("could not lower the persisting thread's priority", exc_info=True)


class _ZipChecksumsOff:
    """While any persist is writing, ``torch.save`` skips the zip format's CRC-32 per record.

    Every blob is covered by the shard's own CRC-32, computed in the same pass as the write; the
    zip's would be another pass over every byte (measured: 0.13-0.16 s of CPU per 300 MB, a
    quarter of a persist's CPU). ``torch.load`` and ``dcp.load`` read such blobs; only zip tools
    would complain. torch's switch is process-wide, so a ``torch.save`` in another thread of
    this process while a persist runs also skips it; the first writer in turns it off and the
    last one out restores the previous setting.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._writers = 0
        self._previous = True

    @contextlib.contextmanager
    def __call__(self) -> Any:
        with self._lock:
            if self._writers == 0:
                self._previous = torch.serialization.get_crc32_options()
                torch.serialization.set_crc32_options(False)
            self._writers += 1
        try:
            yield
        finally:
            with self._lock:
                self._writers -= 1
                if self._writers == 0:
                    torch.serialization.set_crc32_options(self._previous)


zip_checksums_off = _ZipChecksumsOff()


_WRITEBACK_EVERY = 64 << 20
_PARALLEL_CRC_MIN = 4 << 20


def _libc_sync_file_range() -> Any:
    try:
        function = ctypes.CDLL(None, use_errno=True).sync_file_range
    except (OSError, AttributeError):
        return None  # not Linux: the fsync at the end writes everything
    function.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    function.restype = ctypes.c_int
    return function


sync_file_range = _libc_sync_file_range()
_SYNC_FILE_RANGE_WRITE = 2


class ShardStream:
    """The shard file as a write-only stream of ``torch.save`` blobs, each with its CRC-32.

    The CRC of a large write runs on a second thread while the write goes to the disk (both
    release the GIL). Through a buffered file (no ``O_DIRECT`` there) a persist is CPU work (the
    CRC, the copy into the page cache) followed by disk work (the fsync); done one after the
    other, the disk idles while the CPU works, since a shard smaller than the kernel's dirty
    threshold is not written back before the fsync. So every 64 MiB the stream asks the kernel to
    start writing what it has (``sync_file_range(SYNC_FILE_RANGE_WRITE)``, which does not wait).
    """

    def __init__(self, file: Any, checksummer: ThreadPoolExecutor) -> None:
        self._file = file
        self._buffered = not isinstance(file, DirectFile)
        self._checksummer = checksummer
        self._written_back = 0
        self._pending = 0
        self.crc = 0
        self.length = 0
        self.error: BaseException | None = None
        """The first error of a write: ``torch.save`` calls :meth:`write` from C++, and its
        clean-up on the way out can raise an error of its own that hides this one."""

    def write_blob(self, obj: Any) -> dict[str, int]:
        """``torch.save`` of ``obj`` straight to the file (no staging copy); its offset, length
        and CRC-32. A large tensor's blob is placed for its bytes to go to the disk in place."""
        if (not self._buffered and isinstance(obj, torch.Tensor)
                and obj.nbytes >= DIRECT_MIN):
            self._file.write(bytes(padding_before(obj, self._file.tell())))
        offset = self._file.tell()
        self.crc = 0
        self.length = 0
        try:
            torch.save(obj, self)
        except Exception:
            if self.error is not None:
                raise self.error from None
            raise
        return {"offset": offset, "length": self.length, "crc32": self.crc}

    def write(self, data: Any) -> int:
        try:
            return self._write(data)
        except BaseException as e:
            self.error = self.error or e
            raise

    def _write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        if len(view) >= _PARALLEL_CRC_MIN:
            crc = self._checksummer.submit(crc32, view, self.crc)
            written = self._file.write(view)
            self.crc = crc.result()
        else:
            self.crc = crc32(view, self.crc)
            written = self._file.write(view)
        self.length += len(view)
        self._pending += len(view)
        if self._buffered and self._pending >= _WRITEBACK_EVERY:
            self._start_writeback()
        return written

    def flush(self) -> None:
        self._file.flush()

    def _start_writeback(self) -> None:
        self._pending = 0
        if sync_file_range is None:
            return
        self._file.flush()
        end = self._file.tell()
        # Best effort: a failure here only leaves the work to the fsync, which reports errors.
        sync_file_range(self._file.fileno(), self._written_back, end - self._written_back,
                         _SYNC_FILE_RANGE_WRITE)
        self._written_back = end


def same_priority_as_caller() -> Callable[[], None]:
    """An initializer giving a helper thread the calling thread's CPU priority (a persist runs
    at nice 19; its checksum thread must not compete with training at nice 0)."""
    try:
        niceness = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    except (OSError, AttributeError):
        return lambda: None
    return lambda: background_priority(niceness)


class _DataOffset:
    """A sink for a dry run of ``torch.save``: where in the blob the tensor's bytes would go."""

    def __init__(self, nbytes: int) -> None:
        self._nbytes = nbytes
        self._position = 0
        self.found: int | None = None

    def write(self, data: Any) -> int:
        size = memoryview(data).nbytes
        if size == self._nbytes and self.found is None:
            self.found = self._position
        self._position += size
        return size

    def flush(self) -> None:
        pass


def padding_before(tensor: torch.Tensor, position: int) -> int:
    """How many bytes to leave before ``tensor``'s blob, written at ``position``, for its data
    to land at a file offset congruent with its address: the disk then reads it in place.

    A blob's readers go by its recorded offset, so the gap is never read. Should the dry run
    and the real ``torch.save`` ever disagree, the data only goes through the bounce buffer.
    """
    sink = _DataOffset(tensor.nbytes)
    torch.save(tensor, sink)
    if sink.found is None:
        return 0
    return (tensor.data_ptr() - position - sink.found) % _BLOCK
