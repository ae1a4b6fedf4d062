"""The disk tiers (``TierLevel.LOCAL`` and ``TierLevel.REMOTE``): checkpoints on local disk or
shared storage, readable by DCP.

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

import fcntl
import io
import json
import logging
import os
import re
import shutil
import struct
import time
import zipfile
from collections.abc import Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from elasticft.ckpt.api import Snapshot, SnapshotCorrupt, SnapshotMissing, Tier, TierLevel
from elasticft.ckpt.persisting import rejected
from elasticft.ckpt.persisting.diskfile import (
    DirectRefused,
    ShardStream,
    atomic_write,
    crc32,
    disk_error,
    fsync_dir,
    same_priority_as_caller,
    written_atomically,
    zip_checksums_off,
)
from elasticft.ckpt.snapshot import decode_json, dtype_from_name, stored_here, tensor_view

if TYPE_CHECKING:
    from torch.distributed.checkpoint.metadata import Metadata
    from torch.distributed.checkpoint.storage import WriteResult

logger = logging.getLogger(__name__)

COMMIT_MARKER = "COMMITTED"
LAUNCH_MARK = ".elasticft-launch"
"""The launch that last started fresh in a directory (:func:`start_fresh`)."""
_STEP_DIR = re.compile(r"^step-(\d+)$")


def step_dir(root: Path, step: int) -> Path:
    return root / f"step-{step:010d}"


def shard_name(rank: int) -> str:
    return f"__r{rank}.distcp"


def manifest_name(rank: int) -> str:
    return f"r{rank}.json"


def write_rank_shard(root: Path, snapshot: Snapshot, direct: bool = True) -> Path:
    """Writes one rank's shard and manifest durably; returns the step directory.

    ``direct``: the shard file with ``O_DIRECT`` where the filesystem takes it (see
    :class:`DirectFile`); False writes through the page cache (``bench/persist.py`` compares).
    A filesystem that opens with ``O_DIRECT`` but refuses its writes gets the shard again
    through the page cache.
    """
    if direct:
        try:
            return _write_rank_shard(root, snapshot, direct=True)
        except DirectRefused as e:
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
        raise disk_error(e, directory) from None
    final = directory / shard_name(rank)
    storage: dict[str, dict[str, int]] = {}
    with (zip_checksums_off(),
          ThreadPoolExecutor(1, "elasticft-crc", same_priority_as_caller()) as checksummer,
          written_atomically(final, direct=direct) as f):
        shard = ShardStream(f, checksummer)
        for item in manifest["items"]:
            if not stored_here(item):
                continue  # another rank's shard holds this replicated item
            obj: Any = (tensor_view(snapshot.payload, item) if item["kind"] == "tensor"
                        else decode_json(item["value"]))
            storage[item["fqn"]] = shard.write_blob(obj)
    record = dict(manifest, file=final.name, storage=storage, written_at=time.time())
    atomic_write(directory / manifest_name(rank), json.dumps(record).encode())
    fsync_dir(directory)
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
    # DCP's classes are imported when a commit writes its metadata, not with this module: the
    # agent imports it at every launch, and torch.distributed.checkpoint costs over a second.
    from torch.distributed.checkpoint.metadata import (
        BytesStorageMetadata,
        ChunkStorageMetadata,
        Metadata,
        MetadataIndex,
        TensorProperties,
        TensorStorageMetadata,
    )
    from torch.distributed.checkpoint.storage import WriteResult

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
        from torch.distributed.checkpoint import FileSystemWriter

        writer = FileSystemWriter(str(directory), sync_files=True)
        writer.set_up_storage_writer(is_coordinator=True)
        try:
            writer.finish(metadata, [results])
        except OSError as e:
            raise disk_error(e, directory / ".metadata") from None
    marker = {
        "step": step,
        "world_size": world_size,
        "ranks": expected,
        "dcp": complete,
        "committed_at": time.time(),
    }
    atomic_write(directory / COMMIT_MARKER, json.dumps(marker).encode())
    fsync_dir(directory)
    logger.debug("committed checkpoint step %d in %s (%d rank(s))", step, root, len(expected))
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
    """Every committed step of ``root`` and its commit marker, less the rejected ones
    (:mod:`elasticft.ckpt.persisting.rejected`)."""
    out = {}
    entries = rejected.records(root)
    for step, directory in list_steps(root).items():
        info = commit_info(directory)
        if info is not None and rejected.rejecting(step, info.get("committed_at"),
                                                   entries) is None:
            out[step] = info
    return out


def reject_after(root: Path, after: int, reason: str, at: float | None = None) -> list[int]:
    """Rejects every step of ``root`` after ``after``: a rejection record first (so a step
    that lands later is refused too), then the step directories go. Returns the steps
    removed."""
    steps = sorted(s for s in list_steps(root) if s > after)
    rejected.record(root, after, steps, reason, at)
    for step in steps:
        shutil.rmtree(step_dir(root, step), ignore_errors=True)
    return steps


def start_fresh(root: Path, launch: str) -> list[int]:
    """Removes the steps earlier launches left in ``root``, once per launch (``--fresh``).

    Every worker of the launch calls it before it restores. The first (under an exclusive lock
    on :data:`LAUNCH_MARK`) removes every step directory and writes the launch's token there;
    the others, and the launch's restarted workers, find the token and remove nothing: what is
    there now is this launch's own. Returns the steps removed.
    """
    root.mkdir(parents=True, exist_ok=True, mode=0o700)
    with open(root / LAUNCH_MARK, "a+") as mark:
        fcntl.flock(mark, fcntl.LOCK_EX)  # released when the file closes
        mark.seek(0)
        if mark.read().strip() == launch:
            return []
        steps = list_steps(root)
        for directory in steps.values():
            shutil.rmtree(directory, ignore_errors=True)
        mark.seek(0)
        mark.truncate()
        mark.write(launch)
        mark.flush()
        os.fsync(mark.fileno())
    if steps:
        logger.info("--fresh: removed the checkpoint steps %s of earlier launches from %s",
                    sorted(steps), root)
    return sorted(steps)


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
        with open(path, "rb", buffering=0) as f:
            return _decode(manifest, _FileBytes(f), str(path))
    except FileNotFoundError:
        raise SnapshotMissing(f"{path} does not exist") from None


def decode_shard(manifest: Mapping[str, Any], data: bytes | memoryview, where: str) -> Snapshot:
    """The snapshot a shard file's bytes hold (a peer's reply), every blob checked."""
    return _decode(manifest, _MemoryBytes(memoryview(data)), where)


class _MemoryBytes:
    """A shard's bytes in memory, read by offset."""

    def __init__(self, data: memoryview) -> None:
        self._data = data

    def read(self, offset: int, length: int) -> memoryview:
        return self._data[offset : offset + length]

    def read_into(self, offset: int, target: memoryview) -> int:
        part = self._data[offset : offset + len(target)]
        target[: len(part)] = part
        return len(part)


class _FileBytes:
    """A shard file, read by offset (``pread``): a tensor's bytes go straight into the payload."""

    def __init__(self, file: Any) -> None:
        self._fd = file.fileno()

    def read(self, offset: int, length: int) -> memoryview:
        buffer = bytearray(length)
        return memoryview(buffer)[: self.read_into(offset, memoryview(buffer))]

    def read_into(self, offset: int, target: memoryview) -> int:
        done = 0
        while done < len(target):
            got = os.preadv(self._fd, [target[done:]], offset + done)
            if got == 0:
                break  # the file ends early: the caller's length check names it
            done += got
        return done


class _BlobFile(io.RawIOBase):
    """One blob of a shard as a seekable file, for :mod:`zipfile` to find its records in."""

    def __init__(self, source: _MemoryBytes | _FileBytes, start: int, length: int) -> None:
        self._source, self._start, self._length, self._position = source, start, length, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._position

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._position, io.SEEK_END: self._length}[whence]
        self._position = max(0, base + offset)
        return self._position

    def readinto(self, target: Any) -> int:
        view = memoryview(target).cast("B")
        want = max(0, min(len(view), self._length - self._position))
        got = self._source.read_into(self._start + self._position, view[:want])
        self._position += got
        return got


def _tensor_bytes_at(blob: _BlobFile, nbytes: int) -> int | None:
    """Where in a ``torch.save`` blob of one tensor its ``nbytes`` of data begin; None if the
    blob is not laid out so (then it is decoded by ``torch.load``)."""
    try:
        with zipfile.ZipFile(blob) as archive:
            records = [r for r in archive.infolist() if r.filename.split("/")[-2:-1] == ["data"]]
    except (zipfile.BadZipFile, OSError, ValueError, EOFError):
        return None
    if (len(records) != 1 or records[0].compress_type != zipfile.ZIP_STORED
            or records[0].file_size != nbytes):
        return None
    # The local header must agree with the central directory: the CRC covers the blob's bytes,
    # not where the tensor's bytes are said to begin.
    name = records[0].filename.encode()
    header = bytearray(30 + len(name))
    blob.seek(records[0].header_offset)
    if blob.readinto(header) != len(header) or header[:4] != b"PK\x03\x04":
        return None
    name_length, extra_length = struct.unpack_from("<HH", header, 26)
    if name_length != len(name) or header[30:] != name:
        return None
    return records[0].header_offset + 30 + name_length + extra_length


def _decode(manifest: Mapping[str, Any], source: _MemoryBytes | _FileBytes,
            where: str) -> Snapshot:
    """Each tensor's bytes go from ``source`` into their place in a new payload, once: the CRC-32
    runs over the blob's header, those bytes in place, and its tail."""
    payload = bytearray(int(manifest["payload_bytes"]))
    for item in manifest["items"]:
        if not stored_here(item):
            continue  # reassembled from the owner rank on load
        fqn = item["fqn"]
        place = manifest["storage"].get(fqn)
        if place is None:
            raise SnapshotCorrupt(f"{where}: no storage entry for {fqn!r}")
        start, length = int(place["offset"]), int(place["length"])
        if item["kind"] != "tensor":
            blob = source.read(start, length)
            if len(blob) != length or crc32(blob) != place["crc32"]:
                raise SnapshotCorrupt(f"{where}: checksum mismatch in item {fqn!r}")
            continue
        target = tensor_view(payload, item)
        nbytes = target.nbytes
        data_at = _tensor_bytes_at(_BlobFile(source, start, length), nbytes) if nbytes else None
        if data_at is None or data_at + nbytes > length:
            _decode_by_torch_load(source.read(start, length), place, target, fqn, where)
            continue
        into = memoryview(payload)[int(item["offset"]) : int(item["offset"]) + nbytes]
        head = source.read(start, data_at)
        got = source.read_into(start + data_at, into)
        tail = source.read(start + data_at + nbytes, length - data_at - nbytes)
        crc = crc32(tail, crc32(into, crc32(head)))
        if got != nbytes or len(head) + got + len(tail) != length or crc != place["crc32"]:
            raise SnapshotCorrupt(f"{where}: checksum mismatch in item {fqn!r}")
    return Snapshot(dict(manifest), payload)


def _decode_by_torch_load(blob: memoryview, place: Mapping[str, Any], target: torch.Tensor,
                          fqn: str, where: str) -> None:
    if len(blob) != place["length"] or crc32(blob) != place["crc32"]:
        raise SnapshotCorrupt(f"{where}: checksum mismatch in item {fqn!r}")
    try:
        tensor = torch.load(io.BytesIO(blob), map_location="cpu", weights_only=True)
    except Exception as e:
        raise SnapshotCorrupt(f"{where}: item {fqn!r} unreadable ({e})") from None
    if tuple(tensor.shape) != tuple(target.shape) or tensor.dtype != target.dtype:
        raise SnapshotCorrupt(f"{where}: item {fqn!r} has the wrong shape or dtype")
    target.copy_(tensor)


class DurableTier(Tier):
    """A local or remote checkpoint directory, as a source to load from."""

    def __init__(self, root: Path, level: TierLevel = TierLevel.LOCAL) -> None:
        if level not in (TierLevel.LOCAL, TierLevel.REMOTE):
            raise ValueError(f"a checkpoint directory is the local or the remote tier, not "
                             f"{level.name.lower()}")
        self.root = root
        self.level = level
        self.name = level.name.lower()
        self._explained = False

    def steps(self, rank: int, world_size: int) -> list[int]:
        found = sorted(
            (
                step
                for step, info in committed_steps(self.root).items()
                if info.get("world_size") == world_size and rank in info.get("ranks", ())
            ),
            reverse=True,
        )
        if not self._explained and rank == 0:
            self._explained = True  # once per load: why the newest steps are not offered
            for line in rejected.explain(self.root, found[0] if found else None,
                                         rejected.records(self.root)):
                logger.warning("%s", line)
        return found

    def read(self, step: int, rank: int, world_size: int) -> Snapshot:
        directory = step_dir(self.root, step)
        info = commit_info(directory)
        if info is None:
            raise SnapshotMissing(f"{directory} is not committed")
        snapshot = read_rank_shard(directory, rank)
        if snapshot.world_size != world_size or snapshot.step != step:
            raise SnapshotCorrupt(f"{directory}: rank {rank} manifest is for another job layout")
        return snapshot
