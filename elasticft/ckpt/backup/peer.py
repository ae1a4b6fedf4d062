"""The peer tier (``TierLevel.PEER``): each node's shards backed up on another node's agent,
over TCP.

Placement (:func:`backup_node`): when the parallel layout is known, a node backs up to the
nearest node (in ring order) none of whose ranks shares a tensor-, pipeline- or data-parallel
group with any of its own, so evicting a whole parallel group never takes a shard and its
backup together (ByteRobust). Without a layout, or when no node qualifies, the next node in the
ring (TRANSOM).

Wire format: every message is a 4-byte length, a JSON header, and optionally ``body_bytes`` raw
bytes (a shard file exactly as the durable tier writes it). Nothing is pickled. The server binds
the job's address (never all interfaces by default), sends a random nonce, and accepts only a
client that answers with HMAC-SHA256(job secret, nonce); anything else is logged with the reason
and dropped. A received shard is checked blob by blob against its CRC-32 before it is stored, and
stored like the durable tier does (temporary name, fsync, rename, manifest last).

Operations: ``put`` (a rank's shard of a step), ``list`` (steps held for a rank), ``get``.
A server may also answer ``list`` and ``get`` for a rank from a data-parallel *replica* its own
node holds (a :class:`ReplicaSource`): a replacement node then restores the newest step from a
healthy replica's memory, not only the older backup of the node it replaces.

The secret is the round's: the leader of each rendezvous round publishes it, every node of the
round adopts it (:meth:`PeerServer.set_secret`), so a node that left the job no longer gets in.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import json
import logging
import secrets
import socket
import socketserver
import struct
import threading
import zlib
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

from elasticft.ckpt.api import (
    CheckpointError,
    Snapshot,
    SnapshotCorrupt,
    SnapshotMissing,
    Tier,
    TierLevel,
)
from elasticft.ckpt.persisting import diskfile, durable, rejected

logger = logging.getLogger(__name__)

_LEN = struct.Struct(">I")
MAX_HEADER = 64 << 20


def new_secret() -> str:
    return secrets.token_hex(32)


# ----------------------------------------------------------------------------------------------
# Placement.


def _rank_coords(rank: int, tp: int, dp: int) -> tuple[int, int, int]:
    """(tp, dp, pp) coordinates with tensor parallel fastest, then data, then pipeline."""
    return rank % tp, (rank // tp) % dp, rank // (tp * dp)


def _share_group(a: int, b: int, tp: int, dp: int) -> bool:
    ca, cb = _rank_coords(a, tp, dp), _rank_coords(b, tp, dp)
    return sum(x != y for x, y in zip(ca, cb, strict=True)) <= 1


def backup_node(
    node: int, nnodes: int, nproc_per_node: int, layout: tuple[int, int, int] | None = None
) -> int | None:
    """The node that keeps ``node``'s backup; ``layout`` is (tp, pp, dp). None: no other node."""
    if nnodes < 2:
        return None
    next_node = (node + 1) % nnodes
    if layout is None:
        return next_node
    tp, pp, dp = layout
    if tp * pp * dp != nnodes * nproc_per_node:
        logger.warning("layout tp=%d pp=%d dp=%d does not match %d ranks; using the ring",
                       tp, pp, dp, nnodes * nproc_per_node)
        return next_node
    outside = _nearest_node(node, nnodes, nproc_per_node, lambda mine, theirs: not any(
        _share_group(a, b, tp, dp) for a in mine for b in theirs))
    return next_node if outside is None else outside


def replica_node(
    node: int, nnodes: int, nproc_per_node: int, layout: tuple[int, int, int] | None = None
) -> int | None:
    """The nearest node (ring order) holding a data-parallel replica of every rank of ``node``:
    for each of its ranks, one with the same tp and pp coordinates. Its memory has the newest
    step of those shards, which the backup node (deliberately outside these groups) never has.
    Without a layout every rank replicates every other (pure data parallelism)."""
    if nnodes < 2:
        return None
    if layout is None:
        return (node + 1) % nnodes
    tp, pp, dp = layout
    if tp * pp * dp != nnodes * nproc_per_node:
        return None
    return _nearest_node(node, nnodes, nproc_per_node, lambda mine, theirs: all(
        any(_same_shard(a, b, tp, dp) for b in theirs) for a in mine))


def _nearest_node(node: int, nnodes: int, nproc_per_node: int,
                  accept: Callable[[range, range], bool]) -> int | None:
    """The first node after ``node`` in the ring whose ranks ``accept`` takes with its own."""
    mine = range(node * nproc_per_node, (node + 1) * nproc_per_node)
    for k in range(1, nnodes):
        candidate = (node + k) % nnodes
        theirs = range(candidate * nproc_per_node, (candidate + 1) * nproc_per_node)
        if accept(mine, theirs):
            return candidate
    return None


def _same_shard(a: int, b: int, tp: int, dp: int) -> bool:
    (tp_a, _, pp_a), (tp_b, _, pp_b) = _rank_coords(a, tp, dp), _rank_coords(b, tp, dp)
    return (tp_a, pp_a) == (tp_b, pp_b)


# ----------------------------------------------------------------------------------------------
# Framing and authentication.


def _recv_exact(sock: socket.socket, n: int) -> bytearray:
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        k = sock.recv_into(view[got:], n - got)
        if k == 0:
            raise ConnectionError("peer closed the connection")
        got += k
    return buf


def send_message(sock: socket.socket, header: Mapping[str, Any], body: Any = None) -> None:
    head = dict(header)
    if body is not None:
        head["body_bytes"] = len(body)
    raw = json.dumps(head).encode()
    sock.sendall(_LEN.pack(len(raw)) + raw)
    if body is not None:
        sock.sendall(body)


def recv_message(sock: socket.socket) -> tuple[dict[str, Any], bytearray | None]:
    (n,) = _LEN.unpack(_recv_exact(sock, _LEN.size))
    if n > MAX_HEADER:
        raise ConnectionError(f"header of {n} bytes is too large")
    header = json.loads(_recv_exact(sock, n))
    size = header.get("body_bytes")
    body = _recv_exact(sock, int(size)) if size is not None else None
    return header, body


def _proof(secret: str, nonce: str) -> str:
    return hmac.new(secret.encode(), nonce.encode(), hashlib.sha256).hexdigest()


def verify_shard(manifest: Mapping[str, Any], data: bytes | bytearray) -> None:
    view = memoryview(data)
    for fqn, place in manifest["storage"].items():
        blob = view[place["offset"] : place["offset"] + place["length"]]
        if len(blob) != place["length"] or zlib.crc32(blob) != place["crc32"]:
            raise SnapshotCorrupt(f"shard of rank {manifest['rank']}: checksum mismatch in {fqn!r}")


# ----------------------------------------------------------------------------------------------
# Server.


class ReplicaSource(Protocol):
    """Shards of ranks this node holds as data-parallel replicas of another rank."""

    def replica_steps(self, rank: int, world_size: int) -> list[int]: ...

    def replica_shard(self, step: int, rank: int, world_size: int
                      ) -> tuple[dict[str, Any], bytes] | None:
        """(manifest relabelled for ``rank``, shard bytes in the durable format), or None."""
        ...


class PeerServer:
    """Stores other nodes' shards under ``root`` and serves them back; one thread per client."""

    def __init__(self, root: Path, secret: str, host: str, port: int = 0, keep: int = 2,
                 replicas: ReplicaSource | None = None) -> None:
        self.root = root
        self.keep = keep
        self._secret = secret
        self._replicas = replicas
        self._lock = threading.Lock()
        self._refused: tuple[int, int] | None = None
        """Steps (after, through] refused from now on: a rollback rejected them."""
        root.mkdir(parents=True, exist_ok=True, mode=0o700)
        outer = self

        class Handler(socketserver.BaseRequestHandler):
            def handle(self) -> None:
                outer._serve(self.request, self.client_address)

        class Server(socketserver.ThreadingTCPServer):
            daemon_threads = True
            allow_reuse_address = True

        self._server = Server((host, port), Handler)
        self.address = "{}:{}".format(*self._server.server_address[:2])
        self._thread = threading.Thread(
            target=self._server.serve_forever, name="elasticft-ckpt-peer", daemon=True
        )
        self._thread.start()
        logger.info("checkpoint peer server listening on %s", self.address)

    def set_secret(self, secret: str) -> None:
        """Adopts the round's secret; connections authenticated with any other are refused."""
        self._secret = secret

    def _serve(self, sock: socket.socket, client: Any) -> None:
        sock.settimeout(60)
        nonce = secrets.token_hex(16)
        try:
            send_message(sock, {"nonce": nonce})
            header, body = recv_message(sock)
            if not hmac.compare_digest(str(header.get("auth", "")), _proof(self._secret, nonce)):
                logger.warning("rejected checkpoint peer connection from %s: bad job secret",
                               client)
                send_message(sock, {"ok": False, "error": "authentication failed"})
                return
            reply, payload = self._dispatch(header, body)
            send_message(sock, reply, payload)
        except (ConnectionError, OSError, ValueError) as e:
            logger.warning("checkpoint peer connection from %s failed: %s", client, e)
        except CheckpointError as e:
            with contextlib.suppress(OSError):
                send_message(sock, {"ok": False, "error": str(e), "reason": e.reason})

    def _dispatch(self, header: dict[str, Any], body: bytearray | None) -> tuple[dict, Any]:
        op = header.get("op")
        if op == "put":
            manifest = header["manifest"]
            if body is None:
                raise SnapshotMissing("put without a shard body")
            verify_shard(manifest, body)
            refused = self._refused
            if refused is not None and refused[0] < int(manifest["step"]) <= refused[1]:
                raise CheckpointError(f"step {manifest['step']} was rejected after silent data "
                                      f"corruption", reason="rejected")
            self._store(manifest, body)
            return {"ok": True}, None
        if op == "list":
            rank, world = int(header["rank"]), int(header["world_size"])
            steps = set(self.steps(rank, world))
            if self._replicas is not None:
                steps.update(self._replicas.replica_steps(rank, world))
            return {"ok": True, "steps": sorted(steps, reverse=True)}, None
        if op == "get":
            step, rank = int(header["step"]), int(header["rank"])
            directory = durable.step_dir(self.root, step)
            try:
                if step not in self.steps(rank, int(header.get("world_size", -1)), any_world=
                                          "world_size" not in header):
                    raise SnapshotMissing(f"{directory} holds no shard of rank {rank}")
                manifest = durable.read_rank_manifest(directory, rank)
                data = (directory / manifest["file"]).read_bytes()
            except (SnapshotMissing, FileNotFoundError):
                replica = None
                if self._replicas is not None and "world_size" in header:
                    replica = self._replicas.replica_shard(step, rank, int(header["world_size"]))
                if replica is None:
                    raise
                manifest, data = replica
            return {"ok": True, "manifest": manifest}, data
        raise CheckpointError(f"unknown operation {op!r}", reason="bad_request")

    def _store(self, manifest: Mapping[str, Any], data: bytes | bytearray) -> None:
        step, rank = int(manifest["step"]), int(manifest["rank"])
        directory = durable.step_dir(self.root, step)
        directory.mkdir(parents=True, exist_ok=True, mode=0o700)
        diskfile.atomic_write(directory / manifest["file"], data)  # no copy of the shard
        diskfile.atomic_write(directory / durable.manifest_name(rank),
                              json.dumps(manifest).encode())
        with self._lock:
            self._retain(rank)

    def _retain(self, rank: int) -> None:
        held = sorted(
            step for step, d in durable.list_steps(self.root).items()
            if (d / durable.manifest_name(rank)).exists()
        )
        for step in held[: max(0, len(held) - self.keep)]:
            directory = durable.step_dir(self.root, step)
            for name in (durable.manifest_name(rank), durable.shard_name(rank)):
                with contextlib.suppress(FileNotFoundError):
                    (directory / name).unlink()
            with contextlib.suppress(OSError):
                directory.rmdir()

    def steps(self, rank: int, world_size: int, any_world: bool = False) -> list[int]:
        """The steps this store holds of ``rank`` at ``world_size`` (or at any), less the
        rejected ones (:mod:`elasticft.ckpt.persisting.rejected`)."""
        out = []
        entries = rejected.records(self.root)
        for step, directory in durable.list_steps(self.root).items():
            with contextlib.suppress(CheckpointError, OSError):
                manifest = durable.read_rank_manifest(directory, rank)
                written = (directory / durable.manifest_name(rank)).stat().st_mtime
                if (any_world or int(manifest["world_size"]) == world_size) and \
                        rejected.rejecting(step, written, entries) is None:
                    out.append(step)
        return sorted(out, reverse=True)

    def reject_after(self, after: int, through: int, reason: str) -> list[int]:
        """Rejects the backups of every step after ``after``, durably, and refuses the steps
        up to ``through`` from now on (a shard of one that was in flight); the steps removed."""
        with self._lock:
            self._refused = (after, max(through, after))
            return durable.reject_after(self.root, after, reason)

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()


# ----------------------------------------------------------------------------------------------
# Client.


class PeerClient:
    def __init__(self, address: str, secret: str, timeout_s: float = 60.0,
                 connect_timeout_s: float = 5.0) -> None:
        host, _, port = address.rpartition(":")
        self.host, self.port = host, int(port)
        self._secret = secret
        self.timeout_s = timeout_s
        self.connect_timeout_s = connect_timeout_s
        """A peer that is gone must not hold up a restart for long."""

    def _call(self, header: Mapping[str, Any], body: Any = None) -> tuple[dict, bytearray | None]:
        address = (self.host, self.port)
        with socket.create_connection(address, timeout=self.connect_timeout_s) as sock:
            sock.settimeout(self.timeout_s)
            hello, _ = recv_message(sock)
            send_message(sock, dict(header, auth=_proof(self._secret, hello["nonce"])), body)
            reply, payload = recv_message(sock)
        if not reply.get("ok"):
            reason = reply.get("reason", "peer_error")
            raise CheckpointError(f"peer {self.host}:{self.port}: {reply.get('error')}", reason)
        return reply, payload

    def put(self, manifest: Mapping[str, Any], data: bytes | bytearray | memoryview) -> None:
        self._call({"op": "put", "manifest": dict(manifest)}, data)

    def put_from_dir(self, directory: Path, rank: int) -> None:
        manifest = durable.read_rank_manifest(directory, rank)
        self.put(manifest, (directory / manifest["file"]).read_bytes())

    def steps(self, rank: int, world_size: int) -> list[int]:
        reply, _ = self._call({"op": "list", "rank": rank, "world_size": world_size})
        return [int(s) for s in reply["steps"]]

    def get(self, step: int, rank: int, world_size: int | None = None) -> Snapshot:
        header: dict[str, Any] = {"op": "get", "step": step, "rank": rank}
        if world_size is not None:
            header["world_size"] = world_size  # lets the peer answer from a replica
        reply, data = self._call(header)
        if data is None:
            raise SnapshotMissing(f"peer sent no shard for rank {rank} step {step}")
        return durable.decode_shard(reply["manifest"], data, f"peer {self.host}:{self.port}")


class PeerTier(Tier):
    """A peer agent as a source to load from: the backup node ("peer") or a node holding a
    data-parallel replica in memory ("replica")."""

    level = TierLevel.PEER

    def __init__(self, client: PeerClient, name: str = "peer") -> None:
        self.client = client
        self.name = name

    def steps(self, rank: int, world_size: int) -> list[int]:
        try:
            return self.client.steps(rank, world_size)
        except (OSError, CheckpointError) as e:
            logger.warning("checkpoint peer %s:%s unavailable: %s", self.client.host,
                           self.client.port, e)
            return []

    def read(self, step: int, rank: int, world_size: int) -> Snapshot:
        try:
            snapshot = self.client.get(step, rank, world_size)
        except OSError as e:
            raise SnapshotMissing(f"peer unavailable: {e}") from None
        if snapshot.world_size != world_size:
            raise SnapshotCorrupt(f"peer shard of step {step} is for world size "
                                  f"{snapshot.world_size}, not {world_size}")
        return snapshot


def bind_host(preferred: str | None, candidates: Sequence[str]) -> str:
    """The job's address to bind: the user's choice, else the first candidate that is local."""
    if preferred:
        return preferred
    for host in candidates:
        if not host:
            continue
        try:
            with socket.socket() as s:
                s.bind((host, 0))
            return host
        except OSError:
            continue
    return "127.0.0.1"

