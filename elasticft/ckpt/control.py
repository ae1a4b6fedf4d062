"""The "checkpoint now" channel from the agent to its workers.

A worker's main thread may be stuck inside a collective when the agent needs a checkpoint (a
hang, a Slurm time limit, a preemption). Python signal handlers do not run until the collective
returns (CPython runs them on the main thread between bytecodes), so the request goes to a
daemon thread instead: the agent writes ``request.json`` (an id and a reason) into the run's
control directory, each worker's watcher thread sees it within a poll interval, makes sure its
newest snapshot is complete in shared memory (waiting for the copy in flight, which runs on its
own thread), and answers with ``ack-l<local_rank>.json`` naming the step it holds. The agent
then persists that step.
The other way, a worker appends a line to ``skipped-l<local_rank>.jsonl`` for every save it
could not take (no free slot), which the agent turns into ``snapshot_skipped`` events, and
writes ``loaded-l<local_rank>.json`` once its load or restore and the first optimizer step
after it are over, which lets the agent's deferred flush start. A worker whose script chose its
own checkpoint directory announces it in ``ckpt-dir-l<local_rank>.json`` before its first save,
and the agent persists there (:func:`announce_dir`); what a load restored, and from where, is
``restored-l<local_rank>.json``, which the agent logs in one line (:func:`report_restored`).
Files rather than a socket: nothing to bind, owner-only permissions, and it works while the
worker's main thread holds the GIL-free C++ wait of a gloo collective.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import logging
import os
import threading
import time
import uuid
from collections.abc import Callable, Iterable
from pathlib import Path

from elasticft.jsonfile import LineTail, read_json, write_json

logger = logging.getLogger(__name__)

REQUEST = "request.json"


def ack_path(control_dir: Path, local_rank: int) -> Path:
    return control_dir / f"ack-l{local_rank}.json"


def watcher_path(control_dir: Path, local_rank: int) -> Path:
    return control_dir / f"watching-l{local_rank}.json"


def watching_pid(control_dir: Path, local_rank: int) -> int | None:
    """Pid of the worker process whose watcher thread answers for ``local_rank`` (None: none
    has started yet, e.g. a worker still importing torch, which could not answer)."""
    record = read_json(watcher_path(control_dir, local_rank))
    return int(record["pid"]) if record and "pid" in record else None


def bitflip_path(control_dir: Path, local_rank: int) -> Path:
    """A request to flip one bit of the worker's parameters (``elasticft chaos bitflip``)."""
    return control_dir / f"bitflip-l{local_rank}.json"


def flipped_path(control_dir: Path, local_rank: int) -> Path:
    """The worker's answer to a bit-flip request: the step and the tensor it flipped."""
    return control_dir / f"flipped-l{local_rank}.json"


def request_bitflip(control_dir: Path, local_rank: int) -> str:
    """Asks the worker of ``local_rank`` to flip one bit of a parameter at its next save;
    returns the request's id (its answer carries it, :func:`report_flipped`)."""
    request_id = uuid.uuid4().hex
    _write_json(bitflip_path(control_dir, local_rank), {"id": request_id, "time": time.time()})
    return request_id


def report_flipped(control_dir: Path, local_rank: int, request_id: str, **facts: object
                   ) -> None:
    _write_json(flipped_path(control_dir, local_rank), {"id": request_id, **facts})


def read_flipped(control_dir: Path, local_rank: int, request_id: str) -> dict | None:
    answer = read_json(flipped_path(control_dir, local_rank))
    return answer if answer and answer.get("id") == request_id else None


def loaded_path(control_dir: Path, local_rank: int) -> Path:
    return control_dir / f"loaded-l{local_rank}.json"


def report_loaded(control_dir: Path, local_rank: int, step: int | None) -> None:
    """Worker side: this worker's ``load``/``restore`` and the first optimizer step after it are
    over (``step``: what it restored, None for nothing). Until then the agent defers the flush
    of a restart in place, which would compete with both for the same memory and cores."""
    _write_json(loaded_path(control_dir, local_rank), {"pid": os.getpid(), "step": step,
                                                       "time": time.time()})


def clear_loaded(control_dir: Path, local_ranks: Iterable[int]) -> None:
    """Agent side: forgets the previous workers' reports before new workers start."""
    for rank in local_ranks:
        with contextlib.suppress(FileNotFoundError):
            loaded_path(control_dir, rank).unlink()


def all_loaded(control_dir: Path, local_ranks: Iterable[int]) -> bool:
    """Agent side: every one of these local ranks reported its load and first step over."""
    return all(loaded_path(control_dir, rank).exists() for rank in local_ranks)


def announce_dir(control_dir: Path, local_rank: int, directory: Path) -> None:
    """Worker side: the script chose ``directory`` for its checkpoints (``ckpt_dir=``); the
    agent persists this worker's snapshots there instead of in its own directory."""
    _write_json(control_dir / f"ckpt-dir-l{local_rank}.json",
                {"dir": str(directory), "pid": os.getpid()})


def announced_dirs(control_dir: Path, local_ranks: Iterable[int]) -> dict[int, Path]:
    """Agent side: the directories these local ranks' scripts chose, by local rank."""
    found = {}
    for rank in local_ranks:
        record = read_json(control_dir / f"ckpt-dir-l{rank}.json")
        if record and record.get("dir"):
            found[rank] = Path(record["dir"])
    return found


def restored_path(control_dir: Path, local_rank: int) -> Path:
    """Where a worker reports its latest restore (:func:`report_restored`): its ``time`` is
    when the restore ended, which an in-process recovery's phases split on."""
    return control_dir / f"restored-l{local_rank}.json"


def report_restored(control_dir: Path, local_rank: int, step: int | None, source: str | None,
                    where: str, looked: Iterable[str]) -> None:
    """Worker side: what this worker's load restored (``step`` None: nothing), from which tier
    (``source``) and where that is, and which places it looked in."""
    _write_json(restored_path(control_dir, local_rank),
                {"pid": os.getpid(), "step": step, "source": source, "where": where,
                 "looked": list(looked), "time": time.time()})


def restore_line(report: dict) -> str:
    """The agent's one line for a worker's :func:`report_restored` (pure)."""
    step, source, where = report.get("step"), report.get("source"), report.get("where") or ""
    if step is None:
        looked = ", ".join(report.get("looked") or ()) or "no checkpoint tier"
        return f"no checkpoint to resume from (looked in {looked}): starting from the beginning"
    if source in ("local", "remote"):
        return f"resumed from step {step} in {where} ({source} checkpoint directory)"
    if source == "memory":
        return f"resumed from step {step} in shared memory"
    if source == "reshard" and where:
        return f"resumed from step {step} in {where} (resharded from another world size)"
    return f"resumed from step {step} from {where} ({source})" if where else \
        f"resumed from step {step} ({source})"


class RestoreReader:
    """Agent side: the restores workers reported since the last call, one per worker process."""

    def __init__(self) -> None:
        self._seen: dict[int, tuple[int, float]] = {}

    def new_restores(self, control_dir: Path, local_ranks: Iterable[int]) -> dict[int, dict]:
        found = {}
        for rank in local_ranks:
            record = read_json(restored_path(control_dir, rank))
            if not record:
                continue
            key = (int(record.get("pid", 0)), float(record.get("time", 0.0)))
            if self._seen.get(rank) != key:
                self._seen[rank] = key
                found[rank] = record
        return found


def skips_path(control_dir: Path, local_rank: int) -> Path:
    return control_dir / f"skipped-l{local_rank}.jsonl"


def report_skip(control_dir: Path, local_rank: int, rank: int, step: int, reason: str) -> None:
    """Worker side: one line for a save that could not be taken; the agent counts it in the
    event log (``snapshot_skipped``). One ``O_APPEND`` write, so a line is never torn."""
    line = json.dumps({"rank": rank, "step": step, "reason": reason,
                       "pid": os.getpid()}) + "\n"
    fd = os.open(skips_path(control_dir, local_rank), os.O_WRONLY | os.O_CREAT | os.O_APPEND,
                 0o600)
    try:
        os.write(fd, line.encode())
    finally:
        os.close(fd)


class SkipReader:
    """Agent side: the skipped saves workers reported since the last call."""

    def __init__(self) -> None:
        self._tail = LineTail()

    def new_skips(self, control_dir: Path) -> list[dict]:
        found = []
        for path in sorted(control_dir.glob("skipped-l*.jsonl")):
            local_rank = int(path.stem.removeprefix("skipped-l"))
            for line in self._tail.new_lines(path):
                with contextlib.suppress(ValueError):
                    found.append(dict(json.loads(line), local_rank=local_rank))
        return found


_write_json = functools.partial(write_json, private=True, parents=False)
"""The channel's records: this user's only, and only in a control directory that exists (one
its agent removed is not made again)."""


@dataclasses.dataclass(frozen=True)
class Ack:
    local_rank: int
    step: int | None
    """Newest complete snapshot step (None: the worker holds none yet)."""
    error: str = ""


def request_checkpoint(
    control_dir: Path, local_ranks: Iterable[int], reason: str, timeout_s: float,
    alive: Callable[[int], bool] | None = None,
) -> dict[int, Ack]:
    """Agent side: asks every local worker for its newest snapshot; returns the acks received
    within ``timeout_s`` (ranks that did not answer are missing from the result).

    ``alive(local_rank)``, when given, stops the wait for a worker that exited meanwhile (one
    whose collective failed never answers, and must not hold up the restart)."""
    control_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
    request_id = uuid.uuid4().hex
    pending = set(local_ranks)
    for rank in pending:
        with contextlib.suppress(FileNotFoundError):
            ack_path(control_dir, rank).unlink()
    _write_json(control_dir / REQUEST, {"id": request_id, "reason": reason, "time": time.time()})
    acks: dict[int, Ack] = {}
    gone: set[int] = set()
    deadline = time.monotonic() + timeout_s
    while pending and time.monotonic() < deadline:
        for rank in sorted(pending):
            answer = read_json(ack_path(control_dir, rank))
            if answer and answer.get("id") == request_id:
                acks[rank] = Ack(rank, answer.get("step"), answer.get("error", ""))
                pending.discard(rank)
            elif alive is not None and not alive(rank):
                pending.discard(rank)
                gone.add(rank)
        if pending:
            time.sleep(0.02)
    if pending:
        logger.warning("no checkpoint ack from local rank(s) %s within %.1f s", sorted(pending),
                       timeout_s)
    if gone:
        logger.info("local rank(s) %s exited before answering the checkpoint request",
                    sorted(gone))
    return acks


class ControlWatcher:
    """Worker side: a daemon thread answering checkpoint requests with ``respond()``."""

    def __init__(
        self,
        control_dir: Path,
        local_rank: int,
        respond: Callable[[str], int | None],
        poll_s: float = 0.05,
        on_bitflip: Callable[[str], None] | None = None,
    ) -> None:
        self.control_dir = control_dir
        self.local_rank = local_rank
        self._respond = respond
        self._poll_s = poll_s
        self._on_bitflip = on_bitflip
        """Takes a bit-flip request's id (fault injection, :func:`request_bitflip`)."""
        self._stop = threading.Event()
        request = read_json(control_dir / REQUEST)
        self._answered = request.get("id") if request else None  # a request from before us
        flip = read_json(bitflip_path(control_dir, local_rank))
        self._flip_seen = flip.get("id") if flip else None
        with contextlib.suppress(OSError):
            _write_json(watcher_path(control_dir, local_rank), {"pid": os.getpid()})
        self._thread = threading.Thread(
            target=self._run, name=f"elasticft-ckpt-control-{local_rank}", daemon=True
        )
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self._poll_s):
            self._check_bitflip()
            request = read_json(self.control_dir / REQUEST)
            if not request or request.get("id") == self._answered:
                continue
            self._answered = request["id"]
            answer: dict = {"id": request["id"], "time": time.time()}
            try:
                answer["step"] = self._respond(str(request.get("reason", "")))
            except Exception as e:  # the agent must hear back either way
                logger.exception("checkpoint request failed")
                answer.update(step=None, error=f"{type(e).__name__}: {e}")
            _write_json(ack_path(self.control_dir, self.local_rank), answer)

    def _check_bitflip(self) -> None:
        if self._on_bitflip is None:
            return
        flip = read_json(bitflip_path(self.control_dir, self.local_rank))
        if flip and flip.get("id") != self._flip_seen:
            self._flip_seen = flip["id"]
            self._on_bitflip(str(flip["id"]))

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2)
        if watching_pid(self.control_dir, self.local_rank) == os.getpid():
            with contextlib.suppress(OSError):
                watcher_path(self.control_dir, self.local_rank).unlink()
