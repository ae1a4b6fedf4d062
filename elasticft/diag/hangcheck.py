"""Hang evidence: what the monitor gathers about each rank for the hang verdict.

:class:`RankTrack` holds what has been read so far from one rank's rings (its in-flight calls,
call counts per communicator, heartbeat, steps, GPU completions, sampled CPU time).
:func:`rank_views` turns this node's tracks into :class:`~elasticft.diag.detectors.RankView`
facts (reading ``/proc`` only for a rank that may be stuck), and :func:`rank_evidence` turns the
job's views into the :class:`~elasticft.diag.verdict.RankEvidence` that
:func:`~elasticft.diag.verdict.judge` weighs: process state, heartbeat, CPU use per wall second
(measured over about a second with :func:`elasticft.procs.cpu_seconds`), the in-flight calls and
positions per communicator, and whether GPU kernels still complete. Other nodes' ranks come
without CPU or GPU measurements: their own node judges those. :func:`sample_stacks` samples the
Python stacks of ranks (twice for those in a call: does the stack move?), the costly evidence
gathered only when the cheaper evidence finds a hang
(:func:`~elasticft.diag.verdict.stacks_wanted`); :func:`with_stacks` adds them to the evidence.
:func:`hang_limits` maps the options onto the verdict's limits, and :func:`hang_event_evidence`
writes a hang verdict and its evidence for the event log.
"""

from __future__ import annotations

import collections
import dataclasses
import time
from collections.abc import Callable, Collection, Mapping
from typing import Any

from elasticft import procs
from elasticft.addon.api import GroupInfo
from elasticft.config import DiagConfig
from elasticft.diag import detectors, exchange, verdict
from elasticft.diag.ring import Op, Record, RingFiles, RingReader
from elasticft.diag.stacks import stack_signature

NOT_HANG_OPS = {Op.COMM_INIT, Op.COMM_ABORT, Op.COMM_DESTROY, Op.STEP, Op.LOSS}
# A rank without progress for this long, or whose recorder's heartbeat (every 0.1 s) is this
# late, has its process state read (stopped, zombie).
_STATE_AFTER_S = 0.5
_STATE_AFTER_BEAT_S = 0.3
# CPU use is measured over about this long (a tick is 10 ms); GPU kernels count as completing
# when an NCCL call ended this recently.
_CPU_WINDOW_S = 1.0
_GPU_RECENT_S = 2.0


class RankTrack:
    """What has been read so far from one rank's rings."""

    def __init__(self, rank: int, files: RingFiles | None, window: int) -> None:
        self.rank = rank
        self.files = files
        rings = {} if files is None else {"py": files.py, "nccl": files.nccl}
        self.readers = {src: RingReader(path) for src, path in rings.items() if path is not None}
        self.in_flight: dict[tuple[str, int], Record] = {}
        self.comm_seqs: dict[int, int] = {}
        self.spans: collections.deque[tuple[int, int]] = collections.deque(maxlen=4096)
        self.busy: collections.deque[float] = collections.deque(maxlen=window)
        self.losses: collections.deque[float] = collections.deque(maxlen=64)
        self.loss_finding: tuple[detectors.LossFinding, int] | None = None
        self.steps = 0
        self.step_ns = 0
        self.heartbeat_ns = 0
        self.started_ns = 0
        self.shim_status_version: tuple[int, int] | None = None
        """(mtime ns, size) of the rank's NCCL shim status file when it was last reported."""
        # CPU time sampled about once a second: (monotonic ns, CPU seconds) of the reference
        # sample, and the use per wall second measured against it.
        self.cpu_ref: tuple[int, float] | None = None
        self.cpu_fraction: float | None = None
        self.gpu_completed_ns = 0
        self.gpu_seen = False

    def close(self) -> None:
        for reader in self.readers.values():
            reader.close()


def rank_views(tracks: dict[int, RankTrack], group: GroupInfo, now: int
               ) -> list[detectors.RankView]:
    """This node's ranks as the detectors see them at ``now`` (monotonic ns)."""
    pids = {w.global_rank: w.pid for w in group.workers}
    views = []
    for rank, track in sorted(tracks.items()):
        oldest: dict[int, Record] = {}
        for record in track.in_flight.values():
            if record.op in NOT_HANG_OPS:
                continue
            best = oldest.get(record.comm)
            if best is None or record.enqueue_ns < best.enqueue_ns:
                oldest[record.comm] = record
        in_flight = tuple(
            detectors.InFlight(r.op_name, r.comm, r.comm_seq, (now - r.enqueue_ns) / 1e9,
                               "ring") for r in oldest.values())
        since = track.step_ns if track.steps else track.started_ns
        step_age_s = (now - since) / 1e9
        heartbeat_age_s = (now - track.heartbeat_ns) / 1e9 if track.heartbeat_ns else None
        # /proc is read only for a rank that may be stuck: at every check it would be a
        # quarter of the monitor's cost, for a state that matters only to a hang. A stopped
        # process misses its next heartbeat at once, so it is seen within a few tenths.
        stuck = (heartbeat_age_s is None or heartbeat_age_s > _STATE_AFTER_BEAT_S or
                 step_age_s > _STATE_AFTER_S or
                 any(c.age_s > _STATE_AFTER_S for c in in_flight))
        views.append(detectors.RankView(
            rank=rank, node=group.node_id, pid=pids.get(rank),
            process_state=procs.state(pids.get(rank)) if stuck else None,
            heartbeat_age_s=heartbeat_age_s,
            in_flight=in_flight, comm_seqs=dict(track.comm_seqs), steps=track.steps,
            step_age_s=step_age_s))
    return views


def sample_cpu(track: RankTrack, pid: int | None, now: int) -> None:
    """Update the rank's CPU use per wall second, once about a second has passed."""
    cpu = procs.cpu_seconds(pid)
    if cpu is None:
        track.cpu_ref, track.cpu_fraction = None, None
        return
    if track.cpu_ref is None:
        track.cpu_ref = (now, cpu)
        return
    ref_ns, ref_cpu = track.cpu_ref
    elapsed = (now - ref_ns) / 1e9
    if elapsed >= _CPU_WINDOW_S:
        track.cpu_fraction = max(0.0, (cpu - ref_cpu) / elapsed)
        track.cpu_ref = (now, cpu)


def rank_evidence(views: list[detectors.RankView], tracks: dict[int, RankTrack], node: str,
                  now: int, limits: verdict.HangLimits) -> list[verdict.RankEvidence]:
    """Each rank's evidence for the hang verdict; other nodes' ranks (not on ``node``) without
    CPU or GPU measurements (their own node judges those)."""
    result = []
    for view in views:
        track = tracks.get(view.rank) if view.node == node else None
        if track is not None:
            result.append(_local_evidence(view, track, now, limits))
            continue
        remote_call = min(view.in_flight, key=lambda c: -c.age_s, default=None)
        result.append(verdict.RankEvidence(
            view.rank, view.process_state or "S", view.heartbeat_age_s, None, None, None,
            None if remote_call is None else _call(remote_call), **_positions(view)))
    return result


def _call(call: detectors.InFlight) -> verdict.Call:
    return verdict.Call(call.op, call.comm, call.comm_seq, call.age_s,
                        "nccl" if call.source == "nccl" else "py")


def _positions(view: detectors.RankView) -> dict[str, Any]:
    """Where the rank stands on each communicator, as :class:`verdict.RankEvidence` fields."""
    return {"in_flight": tuple(_call(c) for c in view.in_flight),
            "comm_positions": dict(view.comm_seqs), "facts_age_s": view.view_age_s}


def with_stacks(evidence: list[verdict.RankEvidence], moving: Mapping[int, bool],
                dumps: Mapping[int, str]) -> list[verdict.RankEvidence]:
    """The evidence with whether each sampled rank's stack moves and each dumped rank's
    main-thread stack (its py-spy ``dumps``)."""
    result = []
    for e in evidence:
        if e.rank in moving:
            e = dataclasses.replace(e, stack_changed=moving[e.rank])
        if e.rank in dumps:
            e = dataclasses.replace(e, stack=stack_signature(dumps[e.rank]))
        result.append(e)
    return result


def _local_evidence(view: detectors.RankView, track: RankTrack, now: int,
                    limits: verdict.HangLimits) -> verdict.RankEvidence:
    call = None
    oldest = min((item for item in track.in_flight.items() if item[1].op not in NOT_HANG_OPS),
                 key=lambda item: item[1].enqueue_ns, default=None)
    if oldest is not None:
        (source, _), record = oldest
        call = verdict.Call(record.op_name, record.comm, record.comm_seq,
                            (now - record.enqueue_ns) / 1e9,
                            "nccl" if source == "nccl" else "py")
    stuck = view.process_state is not None or call is not None
    if stuck:
        sample_cpu(track, view.pid, now)
    else:
        track.cpu_ref, track.cpu_fraction = None, None
    gpu = None
    if track.gpu_seen:
        gpu = track.gpu_completed_ns > 0 and (now - track.gpu_completed_ns) / 1e9 < _GPU_RECENT_S
    state = view.process_state
    late = view.heartbeat_age_s is None or view.heartbeat_age_s > limits.heartbeat_stale_s
    if state is None:
        # Not read while the rank beats (see rank_views()); read again when it is late, since
        # None there may also mean a process that is gone.
        state = procs.state(view.pid) if late and view.pid else "S"
    return verdict.RankEvidence(view.rank, state, view.heartbeat_age_s, track.cpu_fraction,
                                None, gpu, call,
                                step_age_s=view.step_age_s if view.steps else None,
                                **_positions(view))


def sample_stacks(pids: Mapping[int, int], in_call: Collection[int],
                  dump: Callable[[Mapping[int, int]], dict[int, str]],
                  apart_s: float = 0.5) -> tuple[dict[int, bool], dict[int, str]]:
    """The ranks' Python stacks as they are now (rank -> py-spy's dump), and for the ranks
    ``in_call`` whether their main thread's stack (frames and line numbers) changed since a
    sample ``apart_s`` before. Ranks whose stack could not be read twice are left out of the
    motion: no stack is no evidence either way."""
    calling = {rank: pid for rank, pid in pids.items() if rank in in_call}
    first = dump(calling) if calling else {}
    if calling:
        time.sleep(apart_s)
    now = dump(pids)
    moving = {}
    for rank in calling:
        before = stack_signature(first.get(rank, ""), line_numbers=True)
        after = stack_signature(now.get(rank, ""), line_numbers=True)
        if before and after:
            moving[rank] = before != after
    return moving, now


def hang_limits(config: DiagConfig) -> verdict.HangLimits:
    """The verdict's limits from the options (``DiagConfig()``: their defaults)."""
    return verdict.HangLimits(
        heartbeat_stale_s=config.hang_heartbeat_stale_s, busy_ceiling_s=config.hang_busy_ceiling_s,
        collective_floor_s=config.hang_collective_floor_s, multiple=config.hang_multiple,
        percentile=config.hang_percentile, min_samples=config.hang_min_samples,
        startup_s=config.hang_initial_timeout_s)


def hang_event_evidence(judged: verdict.HangVerdict, ranks_waiting: tuple[int, ...],
                        collective_timeout_s: float, step_timeout_s: float,
                        views: list[detectors.RankView], job: exchange.JobView
                        ) -> dict[str, Any]:
    """What the ``hang`` detection event records: the verdict, its culprits with their nodes and
    the facts that made them culprits, every rank's facts, and the stacks it grouped."""
    node_of = {v.rank: v.node for v in views}
    evidence: dict[str, Any] = {
        "verdict": judged.to_json(),
        "what": judged.what,
        "waited_s": round(judged.waited_s, 3),
        "timeout_s": round(judged.timeout_s or 0.0, 3),
        "collective_timeout_s": round(collective_timeout_s, 3),
        "step_timeout_s": round(step_timeout_s, 3),
        "ranks_waiting": list(ranks_waiting),
        "culprits": [{"rank": rank, "node": node_of.get(rank, ""),
                      "reason": judged.evidence.get(rank, "")} for rank in judged.culprits],
        "ranks": [view_json(v) for v in views],
    }
    if job.silent:
        evidence["silent_nodes"] = job.silent_json()
    if job.digest is not None:
        # Other nodes' ranks came from the job digest: which ones it left out, and where the
        # job stands per communicator.
        evidence["digest"] = dict(job.digest)
    if judged.stacks is not None:
        evidence["stacks"] = judged.stacks.to_json()
    return evidence


def view_json(view: detectors.RankView) -> dict[str, Any]:
    """One rank's view as the hang event records it."""
    return {
        "rank": view.rank,
        "node": view.node,
        "pid": view.pid,
        "state": view.process_state,
        "heartbeat_age_s": None if view.heartbeat_age_s is None else round(view.heartbeat_age_s, 3),
        "steps": view.steps,
        "step_age_s": round(view.step_age_s, 3),
        "in_flight": [{"op": c.op, "comm": f"{c.comm:x}", "comm_seq": c.comm_seq,
                       "age_s": round(c.age_s, 3)} for c in view.in_flight],
        "comm_seqs": {f"{k:x}": v for k, v in view.comm_seqs.items()},
        "view_age_s": round(view.view_age_s, 3),
    }
