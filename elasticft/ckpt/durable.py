"""Tiers 2 and 3: checkpoints on disk (local) or shared storage (remote), readable by DCP.

A checkpoint of step ``s`` is a directory ``step-<s>/`` holding, per rank ``r``:

* ``__r<r>.distcp``: the rank's items, each a ``torch.save`` blob at a recorded offset: the
  file format ``torch.distributed.checkpoint.FileSystemReader`` reads;
* ``r<r>.json``: the rank's manifest (what each item is) plus each blob's offset, length and
  CRC-32, written only after the shard file is durable;

and, once every rank this directory expects is durable, written by one committer:

* ``.metadata``: DCP's metadata (global sizes and chunk offsets of every item, one copy of
  every replicated item), so ``dcp.load`` reads the checkpoint and reshards it to another world
  size; written only when the directory holds every rank of the job;
* ``COMMITTED``: the commit marker (JSON: step, world size, ranks), written last.

Every file is written under a temporary name, fsynced, renamed, and the directory fsynced, so a
crash at any point leaves either nothing or a complete file; a step without ``COMMITTED`` is
never loaded. Retention keeps the newest ``keep`` committed steps.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import io
import json
import logging
import mmap
import os
import re
import shutil
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.storage import WriteResult

from elasticft.ckpt.api import Snapshot, SnapshotCorrupt, SnapshotMissing, StorageFull, Tier
from elasticft.ckpt.snapshot import decode_json, dtype_from_name, stored_here, tensor_view

try:  # zlib-ng's CRC-32 (carry-less multiply): the same values at 3-4x zlib's speed
    from zlib_ng.zlib_ng import crc32
except ImportError:  # no wheel for this platform: the same checksum at zlib's speed
    from zlib import crc32

logger = logging.getLogger(__name__)

COMMIT_MARKER = "COMMITTED"
_STEP_DIR = re.compile(r"^step-(\d+)$")


def step_dir(root: Path, step: int) -> Path:
    return root / f"step-{step:010d}"


def shard_name(rank: int) -> str:
    return f"__r{rank}.distcp"


def manifest_name(rank: int) -> str:
    return f"r{rank}.json"


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _disk_error(e: OSError, path: Path) -> Exception:
    if e.errno in (errno.ENOSPC, errno.EDQUOT):
        return StorageFull(
            f"no space left writing {path}; free space there or point the checkpoint "
            "directory elsewhere (training continues on the memory tier)"
        )
    return e


@contextlib.contextmanager
def _written_atomically(path: Path, direct: bool = False) -> Iterator[Any]:
    """A file to write ``path`` through: written under a temporary name, then fsynced and
    renamed once the block ends, so a crash leaves either nothing or the whole file. A disk error
    removes the temporary file and is raised as one line naming the fix.

    ``direct``: a :class:`_DirectFile` where the filesystem takes ``O_DIRECT``, else a buffered
    file (tmpfs, some network filesystems, a device such as ``/dev/full``)."""
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        with _open_new(tmp, direct) as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as e:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise _disk_error(e, path) from None
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise


def atomic_write(path: Path, data: bytes) -> None:
    with _written_atomically(path) as f:
        f.write(data)


def _open_new(path: Path, direct: bool) -> Any:
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC
    if direct and hasattr(os, "O_DIRECT"):
        try:
            return _DirectFile(os.open(path, flags | os.O_DIRECT, 0o600))
        except OSError as e:
            if e.errno != errno.EINVAL:
                raise
    return open(path, "wb", opener=lambda p, f: os.open(p, f, 0o600))


_BLOCK = 4096
"""The alignment ``O_DIRECT`` asks of file offsets, lengths and memory: a page, which every
Linux block device's logical block divides."""

_DIRECT_MIN = 1 << 20
"""A write at least this large, congruent with its file offset, goes to the disk from the
caller's memory; anything smaller is gathered in the bounce buffer."""


class _DirectRefused(Exception):
    """The filesystem opened a file with ``O_DIRECT`` but refused an aligned write to it."""


def _write_all(fd: int, view: memoryview) -> None:
    while view:
        try:
            written = os.write(fd, view)
        except OSError as e:
            if e.errno == errno.EINVAL:
                raise _DirectRefused(str(e)) from None
            raise
        if written <= 0:
            raise OSError(errno.EIO, "the disk took no bytes")
        view = view[written:]


def _address(view: memoryview) -> int:
    return int(np.frombuffer(view, dtype=np.uint8).ctypes.data) if len(view) else 0


class _DirectFile:
    """A new file written with ``O_DIRECT``: the disk reads large writes from the caller's memory.

    A buffered write copies every byte into the page cache, and the kernel writes it back later:
    a second pass over the snapshot through the CPU and its caches, beside training. Here a
    write of at least :data:`_DIRECT_MIN` bytes whose address is congruent with its file offset
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
        if size >= _DIRECT_MIN and (_address(view) - self._position) % _BLOCK == 0:
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

    def __enter__(self) -> _DirectFile:
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


# ----------------------------------------------------------------------------------------------
# Writing.


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


_zip_checksums_off = _ZipChecksumsOff()


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


_sync_file_range = _libc_sync_file_range()
_SYNC_FILE_RANGE_WRITE = 2


class _ShardStream:
    """The shard file as a write-only stream that keeps each blob's CRC-32 and length.

    The CRC of a large write runs on a second thread while the write goes to the disk (both
    release the GIL). Through a buffered file (no ``O_DIRECT`` there) a persist is CPU work (the
    CRC, the copy into the page cache) followed by disk work (the fsync); done one after the
    other, the disk idles while the CPU works, since a shard smaller than the kernel's dirty
    threshold is not written back before the fsync. So every 64 MiB the stream asks the kernel to
    start writing what it has (``sync_file_range(SYNC_FILE_RANGE_WRITE)``, which does not wait).
    """

    def __init__(self, file: Any, checksummer: ThreadPoolExecutor) -> None:
        self._file = file
        self._buffered = not isinstance(file, _DirectFile)
        self._checksummer = checksummer
        self._written_back = 0
        self._pending = 0
        self.crc = 0
        self.length = 0
        self.error: BaseException | None = None
        """The first error of a write: ``torch.save`` calls :meth:`write` from C++, and its
        clean-up on the way out can raise an error of its own that hides this one."""

    def begin_blob(self) -> None:
        self.crc = 0
        self.length = 0

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
        if _sync_file_range is None:
            return
        self._file.flush()
        end = self._file.tell()
        # Best effort: a failure here only leaves the work to the fsync, which reports errors.
        _sync_file_range(self._file.fileno(), self._written_back, end - self._written_back,
                         _SYNC_FILE_RANGE_WRITE)
        self._written_back = end


def _same_priority_as_caller() -> Callable[[], None]:
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


def _padding_before(tensor: torch.Tensor, position: int) -> int:
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


def write_rank_shard(root: Path, snapshot: Snapshot, direct: bool = True) -> Path:
    """Writes one rank's shard and manifest durably; returns the step directory.

    ``direct``: the shard file with ``O_DIRECT`` where the filesystem takes it (see
    :class:`_DirectFile`); False writes through the page cache (``bench/persist.py`` compares).
    A filesystem that opens with ``O_DIRECT`` but refuses its writes gets the shard again
    through the page cache.
    """
    if direct:
        try:
            return _write_rank_shard(root, snapshot, direct=True)
        except _DirectRefused as e:
            logger.warning("%s refused an O_DIRECT write (%s); writing the shard through the page "
                           "cache", root, e)
    return _write_rank_shard(root, snapshot, direct=False)


def _write_rank_shard(root: Path, snapshot: Snapshot, direct: bool) -> Path:
    manifest = snapshot.manifest
    rank, step = snapshot.rank, snapshot.step
    directory = step_dir(root, step)
    try:
        directory.mkdir(parents=True, exist_ok=True, mode=0o700)
    except OSError as e:
        raise _disk_error(e, directory) from None
    final = directory / shard_name(rank)
    storage: dict[str, dict[str, int]] = {}
    with (_zip_checksums_off(),
          ThreadPoolExecutor(1, "elasticft-crc", _same_priority_as_caller()) as checksummer,
          _written_atomically(final, direct=direct) as f):
        blob = _ShardStream(f, checksummer)
        for item in manifest["items"]:
            if not stored_here(item):
                continue  # another rank's shard holds this replicated item
            if item["kind"] == "tensor":
                obj: Any = tensor_view(snapshot.payload, item)
                if isinstance(f, _DirectFile) and obj.nbytes >= _DIRECT_MIN:
                    f.write(bytes(_padding_before(obj, f.tell())))
            else:
                obj = decode_json(item["value"])
            offset = f.tell()
            blob.begin_blob()
            try:
                torch.save(obj, blob)  # straight to the file: no staging copy
            except Exception:
                if blob.error is not None:
                    raise blob.error from None
                raise
            storage[item["fqn"]] = {"offset": offset, "length": blob.length,
                                    "crc32": blob.crc}
    record = dict(manifest, file=final.name, storage=storage, written_at=time.time())
    atomic_write(directory / manifest_name(rank), json.dumps(record).encode())
    _fsync_dir(directory)
    return directory


def read_rank_manifest(directory: Path, rank: int) -> dict[str, Any]:
    path = directory / manifest_name(rank)
    try:
        return json.loads(path.read_bytes())
    except FileNotFoundError:
        raise SnapshotMissing(f"{path} does not exist") from None
    except ValueError as e:
        raise SnapshotCorrupt(f"{path}: unreadable manifest ({e})") from None


def dcp_metadata(manifests: Iterable[Mapping[str, Any]]) -> tuple[Metadata, list[WriteResult]]:
    """DCP metadata for a set of rank manifests: the first rank holding a chunk provides it."""
    from elasticft.torch_compat import dcp_storage_info  # agent side only; keeps workers lean

    state_md: dict[str, Any] = {}
    planner_data: dict[str, tuple[Any, ...]] = {}
    results: list[WriteResult] = []
    seen: set[MetadataIndex] = set()
    for manifest in sorted(manifests, key=lambda m: m["rank"]):
        for item in manifest["items"]:
            fqn = item["fqn"]
            planner_data[fqn] = tuple(item["path"])
            if not stored_here(item):
                continue  # deduplicated: the owner rank's manifest provides it
            where = manifest["storage"][fqn]
            if item["kind"] == "tensor":
                index = MetadataIndex(fqn, tuple(item["chunk_offsets"]))
                md = state_md.setdefault(
                    fqn,
                    TensorStorageMetadata(
                        properties=TensorProperties(dtype=dtype_from_name(item["dtype"])),
                        size=torch.Size(item["global_size"]),
                        chunks=[],
                    ),
                )
                if index in seen:
                    continue
                md.chunks.append(
                    ChunkStorageMetadata(
                        offsets=torch.Size(item["chunk_offsets"]), sizes=torch.Size(item["shape"])
                    )
                )
            else:
                index = MetadataIndex(fqn)
                state_md.setdefault(fqn, BytesStorageMetadata())
                if index in seen:
                    continue
            seen.add(index)
            results.append(
                WriteResult(
                    index=index,
                    size_in_bytes=where["length"],
                    storage_data=dcp_storage_info(manifest["file"], where["offset"],
                                                  where["length"]),
                )
            )
    return Metadata(state_dict_metadata=state_md, planner_data=planner_data), results


def try_commit(root: Path, step: int, world_size: int, ranks: Iterable[int]) -> bool:
    """Commits ``step`` if every rank in ``ranks`` is durable there; True once committed.

    ``ranks`` are the ranks this directory holds (all of them for a shared or single-node
    directory, this node's for a node-local one). DCP's ``.metadata`` is written only when they
    cover the whole job.
    """
    directory = step_dir(root, step)
    if (directory / COMMIT_MARKER).exists():
        return True
    expected = sorted(set(ranks))
    if not all((directory / manifest_name(r)).exists() for r in expected):
        return False
    complete = expected == list(range(world_size))
    if complete:
        manifests = [read_rank_manifest(directory, r) for r in expected]
        metadata, results = dcp_metadata(manifests)
        writer = FileSystemWriter(str(directory), sync_files=True)
        writer.set_up_storage_writer(is_coordinator=True)
        try:
            writer.finish(metadata, [results])
        except OSError as e:
            raise _disk_error(e, directory / ".metadata") from None
    marker = {
        "step": step,
        "world_size": world_size,
        "ranks": expected,
        "dcp": complete,
        "committed_at": time.time(),
    }
    atomic_write(directory / COMMIT_MARKER, json.dumps(marker).encode())
    _fsync_dir(directory)
    logger.info("committed checkpoint step %d in %s (%d rank(s))", step, root, len(expected))
    return True


def commit_pending(root: Path, pending: set[int], world_size: int, ranks: Iterable[int],
                   keep: int) -> list[int]:
    """Commits every pending step whose ranks are all durable now; never waits.

    Writers on other ranks or nodes may skip a step (a busy writer, a missed interval), so a
    step can stay incomplete forever: once a newer step is committed, older pending ones are
    dropped and retention removes their leftovers.
    """
    ranks = list(ranks)
    committed = [s for s in sorted(pending) if try_commit(root, s, world_size, ranks)]
    if committed:
        pending.difference_update(s for s in list(pending) if s <= committed[-1])
        retain(root, keep)
    return committed


def list_steps(root: Path) -> dict[int, Path]:
    found = {}
    if root.is_dir():
        for path in root.iterdir():
            match = _STEP_DIR.match(path.name)
            if match and path.is_dir():
                found[int(match.group(1))] = path
    return found


def commit_info(directory: Path) -> dict[str, Any] | None:
    try:
        return json.loads((directory / COMMIT_MARKER).read_bytes())
    except (FileNotFoundError, ValueError):
        return None


def committed_steps(root: Path) -> dict[int, dict[str, Any]]:
    out = {}
    for step, directory in list_steps(root).items():
        info = commit_info(directory)
        if info is not None:
            out[step] = info
    return out


def retain(root: Path, keep: int) -> list[int]:
    """Keeps the newest ``keep`` committed steps; removes older steps (committed or torn)."""
    committed = sorted(committed_steps(root))
    if keep <= 0 or len(committed) <= keep:
        return []
    oldest_kept = committed[-keep]
    removed = []
    for step, directory in sorted(list_steps(root).items()):
        if step < oldest_kept:
            shutil.rmtree(directory, ignore_errors=True)
            removed.append(step)
    return removed


# ----------------------------------------------------------------------------------------------
# Reading.


def read_rank_shard(directory: Path, rank: int) -> Snapshot:
    """One rank's snapshot from a step directory, every blob checked against its CRC-32."""
    manifest = read_rank_manifest(directory, rank)
    path = directory / manifest["file"]
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise SnapshotMissing(f"{path} does not exist") from None
    return decode_shard(manifest, data, str(path))


def decode_shard(manifest: Mapping[str, Any], data: bytes | memoryview, where: str) -> Snapshot:
    payload = bytearray(int(manifest["payload_bytes"]))
    view = memoryview(data)
    for item in manifest["items"]:
        if not stored_here(item):
            continue  # reassembled from the owner rank on load
        place = manifest["storage"].get(item["fqn"])
        if place is None:
            raise SnapshotCorrupt(f"{where}: no storage entry for {item['fqn']!r}")
        blob = view[place["offset"] : place["offset"] + place["length"]]
        if len(blob) != place["length"] or crc32(blob) != place["crc32"]:
            raise SnapshotCorrupt(f"{where}: checksum mismatch in item {item['fqn']!r}")
        if item["kind"] != "tensor":
            continue
        try:
            tensor = torch.load(io.BytesIO(blob), map_location="cpu", weights_only=True)
        except Exception as e:
            raise SnapshotCorrupt(f"{where}: item {item['fqn']!r} unreadable ({e})") from None
        target = tensor_view(payload, item)
        if tuple(tensor.shape) != tuple(target.shape) or tensor.dtype != target.dtype:
            raise SnapshotCorrupt(f"{where}: item {item['fqn']!r} has the wrong shape or dtype")
        target.copy_(tensor)
    return Snapshot(dict(manifest), payload)


class DurableTier(Tier):
    """A local or remote checkpoint directory, as a source to load from."""

    def __init__(self, root: Path, name: str = "local") -> None:
        self.root = root
        self.name = name

    def steps(self, rank: int, world_size: int) -> list[int]:
        return sorted(
            (
                step
                for step, info in committed_steps(self.root).items()
                if info.get("world_size") == world_size and rank in info.get("ranks", ())
            ),
            reverse=True,
        )

    def read(self, step: int, rank: int, world_size: int) -> Snapshot:
        directory = step_dir(self.root, step)
        info = commit_info(directory)
        if info is None:
            raise SnapshotMissing(f"{directory} is not committed")
        snapshot = read_rank_shard(directory, rank)
        if snapshot.world_size != world_size or snapshot.step != step:
            raise SnapshotCorrupt(f"{directory}: rank {rank} manifest is for another job layout")
        return snapshot
