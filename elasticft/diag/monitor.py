"""The diagnostics monitor: the agent collaborator that watches this node's workers.

Before workers start it prepares their progress rings (owner-only files with no name on
``/dev/shm``, which need no removal: :class:`elasticft.diag.workerenv.WorkerFiles`) and computes
their environment (:mod:`elasticft.diag.workerenv`: the ring files, the bootstrap
on ``PYTHONPATH`` for unmodified scripts, the NCCL shim in ``LD_PRELOAD`` on GPU nodes). After
the first rendezvous, before any worker, it runs the pre-flight check of the node. Then, every
monitor interval, :meth:`DiagMonitor.check` makes one pass: it gathers the evidence (polls the
rings, and asks :mod:`elasticft.diag.hangcheck` for every rank's facts, py-spy stacks only when
the cheaper facts find a hang), judges the hang once (:func:`elasticft.diag.verdict.judge`), and
acts on the first finding (:mod:`elasticft.diag.detectors` for the others):

* a hang returns a :class:`Detection` (``FailureClass.HANG``) naming the culprit ranks the
  verdict names, and records its evidence (every rank's position per communicator, process
  states, the grouped stacks);
* a NaN/inf loss or a loss spike returns one too (``diag_loss_action=restart``, the default);
* a slow rank, an error-line burst in the logs and non-critical node issues are reported;
* a critical node issue (vanished GPU, ECC errors, full disk, memory exhausted) returns a
  Detection with ``node_suspect`` so the policy may evict the node.

Every finding is written to the event log as a ``detection`` event with its evidence. Node health
runs on its own thread so that ``check`` stays a few hundred microseconds.
"""

from __future__ import annotations

import collections
import logging
import re
import statistics
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, ClassVar

from elasticft.addon.api import (
    AddOn,
    AddOnContext,
    AgentCollaborator,
    Detection,
    GroupInfo,
    WorkerInfo,
)
from elasticft.addon.classify import FailureClass
from elasticft.config import DiagConfig
from elasticft.diag import detectors, exchange, hangcheck, health, shimcheck, stacks, verdict
from elasticft.diag.hangcheck import NOT_HANG_OPS, RankTrack, hang_limits
from elasticft.diag.logscan import LogScanner
from elasticft.diag.metrics import DiagMetrics
from elasticft.diag.ring import Op, Record
from elasticft.diag.workerenv import (
    WorkerFiles,
    bootstrap_dir,
    default_ring_base,
    diag_worker_env,
    shim_library,
)
from elasticft.events import EventLog

logger = logging.getLogger(__name__)

# A wait longer than this that is not a hang is reported (once per wait).
_REPORT_WAIT_S = 5.0
# How long a sample of the stacks stands as evidence (where they are, and whether they move).
_STACK_SAMPLE_TTL_S = 5.0


class DiagMonitor(AgentCollaborator):
    """Hang, slow-rank, loss, log and node-health detection for one node's workers."""

    def __init__(
        self,
        config: DiagConfig,
        *,
        base_env: Mapping[str, str],
        events: EventLog | None = None,
        event_dir: Path | None = None,
        log_root: Path | None = None,
        nccl_shim: Path | None = None,
        clock_ns: Callable[[], int] = time.monotonic_ns,
        stack_dumper: Callable[[Mapping[int, int]], dict[int, str]] = stacks.dump_stacks,
        views_exchange: exchange.ViewExchange | None = None,
        metrics: DiagMetrics | None = None,
    ) -> None:
        self.config = config
        self.metrics = metrics
        self._base_env = dict(base_env)
        self._event_dir = event_dir
        self._log_root = log_root
        self._shim = nccl_shim
        self._clock_ns = clock_ns
        self._dump_stacks = stack_dumper
        self._limits = health.HealthLimits(config.health_min_free_gb,
                                           config.health_max_memory_percent,
                                           config.health_max_gpu_temp_c)
        self._events = events
        """The agent's event log; opened here (under ``event_dir``, else the run directory)
        only for a monitor built outside an agent, which then closes it too."""
        self._owns_events = events is None
        self._ring_base: Path | None = None
        self._files: dict[int, WorkerFiles] = {}  # by global rank
        self._tracks: dict[int, RankTrack] = {}
        self._coll_history: collections.deque[float] = collections.deque(
            maxlen=config.hang_history)
        self._last_eval_ns = 0
        self._pending: Detection | None = None
        self._pending_lock = threading.Lock()
        self._reported: set[str] = set()
        self._slow_since: dict[int, int] = {}
        self._preflight_done = False
        self._gpus: health.GpuHealth | None = None
        self._health_stop = threading.Event()
        self._health_thread: threading.Thread | None = None
        self._group: GroupInfo | None = None
        self._log_scanner = LogScanner(re.compile(config.diag_log_pattern),
                                        config.diag_log_window_s)
        # Other nodes' ranks, read from the round's store (multi-node jobs only).
        self._exchange = views_exchange or exchange.ViewExchange()
        self._limits_hang = hang_limits(config)
        self.last_verdict: verdict.HangVerdict | None = None
        self._stack_sample: tuple[float, dict[int, bool], dict[int, str]] | None = None

    # -- set-up ---------------------------------------------------------------------------------

    def _open(self, group: GroupInfo) -> None:
        if self._events is None:
            self._events = EventLog(self._event_dir or group.run_dir, group.node_id)
        if self._ring_base is None:
            # What gone agents left there, the launcher swept at the start
            # (:func:`elasticft.launcher.sweep_leftovers`).
            self._ring_base = Path(self.config.diag_ring_dir or default_ring_base())

    def emit(self, detector: str, message: str, **evidence: Any) -> None:
        logger.warning("detection (%s): %s", detector, message)
        if self.metrics is not None:
            self.metrics.detection(detector)
        if self._events is not None:
            self._events.emit("detection", detector=detector, message=message, **evidence)

    def worker_env(self, group: GroupInfo, worker: WorkerInfo) -> Mapping[str, str]:
        self._open(group)
        assert self._ring_base is not None
        # Fresh files for every start: the previous worker of this rank is gone.
        previous = self._files.pop(worker.global_rank, None)
        if previous is not None:
            previous.close()
        files = WorkerFiles(self._ring_base, worker.global_rank, self.config.diag_ring_capacity,
                            status=self._shim is not None)
        self._files[worker.global_rank] = files
        return diag_worker_env(files.files, auto_install=self.config.diag_auto_install,
                               shim=self._shim, base_env=self._base_env)

    def python_path(self) -> tuple[Path, ...]:
        # The recorder's bootstrap (elasticft.diag.autoinstall), for scripts that call nothing.
        return (bootstrap_dir(),) if self.config.diag_auto_install else ()

    def _run_preflight(self, group: GroupInfo) -> None:
        started = time.monotonic()
        self._gpus = health.GpuHealth()
        issues = health.preflight(self._dirs(group), self._limits, self._gpus)
        probe = None
        if self.config.diag_preflight == "allreduce":
            probe = health.allreduce_probe(max(1, len(group.workers)))
            issues += probe.issues
        if self._events is not None:
            self._events.emit("preflight", ok=not any(i.critical for i in issues),
                              issues=[i.to_json() for i in issues],
                              gpus=self._gpus.available, seconds=time.monotonic() - started,
                              allreduce=None if probe is None else probe.to_json())
        self._health_findings(issues, "preflight")

    def _dirs(self, group: GroupInfo) -> list[Path]:
        return [group.run_dir, *(Path(d) for d in self.config.health_dirs)]

    def on_rendezvous(self, group: GroupInfo, store: Any) -> None:
        self._exchange.attach(store, group.node_id, group.group_rank, group.group_world_size,
                              hub_host=group.master_addr or None)
        if not self._preflight_done:
            # The node is checked once, when the first round is known and before any worker.
            self._preflight_done = True
            if self.config.diag_preflight != "off":
                self._open(group)
                self._run_preflight(group)

    def on_workers_started(self, group: GroupInfo) -> None:
        self._open(group)
        self._group = group
        if self.metrics is not None:
            self.metrics.group(group.restart_count, group.round, len(group.workers))
        for track in self._tracks.values():
            track.close()
        now = self._clock_ns()
        self._tracks = {}
        for w in group.workers:
            files = self._files.get(w.global_rank)
            track = RankTrack(w.global_rank, None if files is None else files.files,
                              self.config.slow_window)
            track.started_ns = now
            self._tracks[w.global_rank] = track
        self._slow_since.clear()
        self._reported = {k for k in self._reported if k.startswith("health:")}
        self._log_scanner.reset(self._log_root)
        if self._health_thread is None:
            self._health_thread = threading.Thread(target=self._health_loop, daemon=True,
                                                   name="elasticft-diag-health")
            self._health_thread.start()

    def on_workers_stopped(self, group: GroupInfo) -> None:
        # Nothing to publish until the next round (and the launcher may close the store now).
        self._exchange.detach()
        for track in self._tracks.values():
            track.close()
        self._tracks = {}
        self._stack_sample = None
        with self._pending_lock:
            if self._pending is not None and not self._pending.node_suspect:
                self._pending = None

    def close(self) -> None:
        # The rings go whatever else fails here (a SIGKILL frees them as well: they have no
        # name, and the workers' mappings go with the workers).
        try:
            self._health_stop.set()
            if self.metrics is not None:
                self.metrics.close()
            self._exchange.close()
            for track in self._tracks.values():
                track.close()
            self._tracks = {}
        finally:
            for files in self._files.values():
                files.close()
            self._files = {}
            if self._events is not None and self._owns_events:
                self._events.close()

    # -- node health ----------------------------------------------------------------------------

    def _health_loop(self) -> None:
        while not self._health_stop.wait(self.config.health_interval_s):
            group = self._group
            if group is None:
                continue
            try:
                issues = health.node_health(self._dirs(group), self._limits, self._gpus)
            except Exception:
                logger.exception("node health check failed")
                continue
            self._health_findings(issues, "node_health")

    def _health_findings(self, issues: list[health.HealthIssue], detector: str) -> None:
        for issue in issues:
            key = f"health:{issue.check}:{issue.message}"
            if key not in self._reported:
                self._reported.add(key)
                self.emit(detector, issue.message, check=issue.check, critical=issue.critical)
        critical = [i for i in issues if i.critical]
        if critical:
            with self._pending_lock:
                self._pending = Detection(
                    FailureClass.INFRASTRUCTURE, (), detector,
                    "; ".join(i.message for i in critical), node_suspect=True,
                    evidence={"issues": [i.to_json() for i in critical]})

    # -- the periodic check -----------------------------------------------------------------------

    def recent_collective_durations(self) -> tuple[float, ...]:
        """Seconds of the recent collectives this node saw complete (the metrics' quantiles)."""
        return tuple(self._coll_history)

    def check(self, group: GroupInfo) -> Detection | None:
        """One pass: gather the evidence (the rings, this node's ranks, the job's), judge the hang
        once, then act on the first finding: the hang, a loss, a slow rank, an error burst. A
        critical node issue the health thread found meanwhile comes before all of them."""
        with self._pending_lock:
            pending, self._pending = self._pending, None
        if pending is not None:
            return pending
        now = self._clock_ns()
        if now - self._last_eval_ns < self.config.diag_check_interval_s * 1e9:
            return None
        self._last_eval_ns = now
        self._group = group
        for track in self._tracks.values():
            self._poll(track, now)
        views = self.views(group, now)
        busy = self._busy_medians()
        if self._exchange.active:
            self._exchange.offer(views, busy)
        job = self._exchange.job_view()
        evidence, stacks_now = self._hang_evidence(views, job, now)
        judged = verdict.judge(verdict.JobSnapshot(tuple(evidence), tuple(self._coll_history)),
                               self._limits_hang)
        self.last_verdict = judged
        return (self._act_on_hang(judged, views, job, stacks_now) or self._check_loss() or
                self._check_slow(now, busy, job) or self._check_logs(group, now))

    def _poll(self, track: RankTrack, now: int) -> None:
        if self._shim is not None:
            self._report_shim(track)
        for source, reader in track.readers.items():
            header, records = reader.poll()
            if header is None:
                continue
            if source == "py":
                track.heartbeat_ns = header.heartbeat_ns
            # Calls seen in flight earlier: have they completed since?
            for key in [k for k in track.in_flight if k[0] == source]:
                fresh = reader.read_slot(key[1], header.capacity)
                if fresh is None:
                    del track.in_flight[key]
                elif not fresh.in_flight:
                    del track.in_flight[key]
                    self._completed(track, fresh)
            for record in records:
                self._new_record(track, source, record)

    def _report_shim(self, track: RankTrack) -> None:
        """The worker's NCCL shim self-check, when it is written and each time the worker
        rewrites it (it finds that torch's NCCL calls bypass the shim); one log line a node."""
        changed = shimcheck.changed_status(track.files.status if track.files else None,
                                           track.shim_status_version)
        if changed is None:
            return
        track.shim_status_version, status = changed
        message = str(status.get("message", ""))
        if self._events is not None:
            self._events.emit(shimcheck.EVENT_KIND, **status)
        if message not in self._reported:
            self._reported.add(message)
            if status.get("active"):
                logger.info("rank %d: %s", track.rank, message)
            else:
                logger.warning("rank %d: %s; hangs are still detected from the Python recorder, "
                               "heartbeats and process state", track.rank, message)

    def _new_record(self, track: RankTrack, source: str, record: Record) -> None:
        op = record.op
        if op == Op.STEP:
            track.steps = int(record.value)
            track.step_ns = record.complete_ns
            if track.steps > 1:
                track.busy.append(detectors.busy_time(record.enqueue_ns, record.complete_ns,
                                                      track.spans))
            # Steps start later and later: a call that ended before this one began is of no
            # use to any later step, and sorting the whole history each step costs the agent
            # milliseconds per check in a long run.
            while track.spans and track.spans[0][1] <= record.enqueue_ns:
                track.spans.popleft()
            if self.metrics is not None:
                self.metrics.step(track.rank, track.steps, (record.complete_ns - record.enqueue_ns)
                                  / 1e9 if track.steps > 1 else None)
            return
        if op == Op.LOSS:
            # Judge every loss as it arrives: several may come between two checks.
            track.losses.append(record.value)
            if track.loss_finding is None:
                finding = detectors.check_loss(list(track.losses),
                                               self.config.diag_loss_spike_factor)
                if finding is not None:
                    track.loss_finding = (finding, int(record.peer))
                    track.losses.clear()
            return
        if source == "nccl":
            track.gpu_seen = True
        if record.comm and record.comm_seq:
            track.comm_seqs[record.comm] = max(track.comm_seqs.get(record.comm, 0),
                                               record.comm_seq)
        if record.in_flight:
            track.in_flight[(source, record.seq)] = record
        else:
            self._completed(track, record)

    def _completed(self, track: RankTrack, record: Record) -> None:
        if record.op in NOT_HANG_OPS:
            return
        if record.complete_ns > track.gpu_completed_ns and track.gpu_seen:
            track.gpu_completed_ns = max(track.gpu_completed_ns, record.complete_ns)
        # A communicator's first call absorbs the start-up skew between ranks (nodes start
        # seconds apart): learning from it would stretch the hang timeout for a hundred calls.
        if record.comm_seq != 1:
            self._coll_history.append((record.complete_ns - record.enqueue_ns) / 1e9)
        track.spans.append((record.enqueue_ns, record.complete_ns))
        if self.metrics is not None:
            self.metrics.collective(self._coll_history[-1])

    def evidence(self, views: list[detectors.RankView], now: int) -> list[verdict.RankEvidence]:
        """Each rank's evidence for the hang verdict (:func:`hangcheck.rank_evidence`)."""
        node = self._group.node_id if self._group is not None else ""
        return hangcheck.rank_evidence(views, self._tracks, node, now, self._limits_hang)

    def views(self, group: GroupInfo, now: int) -> list[detectors.RankView]:
        """This node's ranks as the detectors see them (:func:`hangcheck.rank_views`)."""
        return hangcheck.rank_views(self._tracks, group, now)

    def _hang_evidence(self, views: list[detectors.RankView], job: exchange.JobView, now: int
                       ) -> tuple[list[verdict.RankEvidence], dict[int, str]]:
        """Every fresh rank of the job as the verdict's evidence (this node acts on what its own
        ranks show), with py-spy's stacks of this node's ranks when the cheaper evidence finds a
        hang they take part in; and those stacks (rank -> dump)."""
        evidence = self.evidence([*views, *job.views], now)
        if not self.config.hang_stacks:
            return evidence, {}
        cheap = verdict.JobSnapshot(tuple(evidence), tuple(self._coll_history))
        if not verdict.stacks_wanted(cheap, self._limits_hang) & {v.rank for v in views}:
            return evidence, {}
        moving, dumps = self._sample_stacks(views)
        return hangcheck.with_stacks(evidence, moving, dumps), dumps

    def _sample_stacks(self, views: list[detectors.RankView]
                       ) -> tuple[dict[int, bool], dict[int, str]]:
        """This node's ranks' stacks and, for those in a call, whether they move
        (:func:`hangcheck.sample_stacks`); sampled at most every ``_STACK_SAMPLE_TTL_S``."""
        at = time.monotonic()
        if self._stack_sample is not None and at - self._stack_sample[0] < _STACK_SAMPLE_TTL_S:
            return self._stack_sample[1], self._stack_sample[2]
        pids = {v.rank: v.pid for v in views if v.pid}
        in_call = {v.rank for v in views if v.in_flight}
        moving, dumps = hangcheck.sample_stacks(pids, in_call, self._dump_stacks)
        self._stack_sample = (at, moving, dumps)
        return moving, dumps

    def _act_on_hang(self, judged: verdict.HangVerdict, views: list[detectors.RankView],
                     job: exchange.JobView, stacks_now: Mapping[int, str]) -> Detection | None:
        """Reports a long wait that is no hang (once); the hang this node acts on, if any."""
        if judged.kind == "working" and judged.waited_s > _REPORT_WAIT_S:
            self._report_wait(judged, views, stacks_now)
        elif judged.kind != "working":
            self._reported = {k for k in self._reported if not k.startswith("waiting:")}
        local = {v.rank for v in views}
        if not judged.hang or not local & {*judged.waiting, *judged.culprits}:
            return None  # a hang none of this node's ranks takes part in is its nodes' to act on
        if ((not judged.culprits or judged.named_by_stacks) and self._exchange.active and
                judged.waited_s < (judged.timeout_s or 0.0) + self._exchange.stale_after_s):
            # Another node's summary may not show the culprit yet: give it a few publications.
            return None
        job_views = [*views, *job.views]
        node_of = {v.rank: v.node for v in job_views}
        names = ", ".join(f"rank {rank} on {node_of.get(rank, '')}"
                          for rank in judged.culprits) or "not localised"
        if not judged.culprits and job.silent:
            names += " (silent: " + ", ".join(
                f"{n.node} for {n.age_s:.0f} s" for n in job.silent) + ")"
        message = f"hang ({judged.kind}): {judged.what}; culprit: {names}"
        # This node's ranks that wait (the verdict names the job's in its own evidence).
        local_waiting = tuple(r for r in judged.waiting if r in local)
        evidence = hangcheck.hang_event_evidence(
            judged, local_waiting,
            verdict.collective_timeout(tuple(self._coll_history), self._limits_hang),
            self._limits_hang.busy_ceiling_s, job_views, job)
        self.emit("hang", message, **evidence)
        return Detection(FailureClass.HANG, judged.culprits or local_waiting, "hang", message,
                         evidence=evidence)

    def _report_wait(self, judged: verdict.HangVerdict, views: list[detectors.RankView],
                     stacks_now: Mapping[int, str]) -> None:
        """Not a hang: says once who the others wait for and what it is doing."""
        key = f"waiting:{judged.culprits}"
        if key in self._reported:
            return
        self._reported.add(key)
        tops = self._stack_tops(views, judged.culprits, stacks_now)
        doing = "".join(f"; rank {rank} is at {top}" for rank, top in tops.items())
        self.emit("hang_verdict", f"not a hang: {judged.what}{doing}", verdict=judged.to_json(),
                  stacks={str(rank): top for rank, top in tops.items()})

    def _stack_tops(self, views: list[detectors.RankView], ranks: tuple[int, ...],
                    stacks_now: Mapping[int, str]) -> dict[int, str]:
        """The innermost frames of this node's ``ranks`` (what the others wait for), from this
        check's stacks when it sampled them all."""
        pids = {v.rank: v.pid for v in views if v.pid and v.rank in ranks}
        if not pids or not self.config.hang_stacks:
            return {}
        dumps = ({rank: stacks_now[rank] for rank in pids} if pids.keys() <= stacks_now.keys()
                 else self._dump_stacks(pids))
        signatures = {rank: stacks.stack_signature(text) for rank, text in dumps.items()}
        return {rank: sig.splitlines()[0] for rank, sig in signatures.items() if sig}

    def _check_loss(self) -> Detection | None:
        for rank, track in self._tracks.items():
            if track.loss_finding is None:
                continue
            finding, step = track.loss_finding
            track.loss_finding = None
            message = f"{finding.kind} loss on rank {rank} at step {step}: {finding.message}"
            self.emit(f"loss_{finding.kind}", message, rank=rank, step=step,
                      value=str(finding.value), baseline=finding.baseline)
            if self.config.diag_loss_action == "restart":
                return Detection(FailureClass.NUMERIC, (rank,), f"loss_{finding.kind}", message,
                                 evidence={"value": str(finding.value)})
        return None

    def _busy_medians(self) -> dict[int, float]:
        """Median busy time per step of this node's ranks that have enough recent steps."""
        return {rank: statistics.median(t.busy) for rank, t in self._tracks.items()
                if len(t.busy) >= max(3, self.config.slow_window // 2)}

    def _check_slow(self, now: int, local_busy: dict[int, float], job: exchange.JobView
                    ) -> Detection | None:
        # Every rank of the job is compared with every other, whatever its node.
        busy = {**job.busy, **local_busy}
        if not busy or (len(busy) < 2 and job.busy_stats is None):
            return None
        here = self._group.node_id if self._group else ""
        node_of = {**job.node_of, **dict.fromkeys(local_busy, here)}
        leader = self._group is None or self._group.group_rank == 0
        if job.busy_stats is None:
            slow = detectors.find_slow(busy, self.config.slow_ratio,
                                       self.config.slow_min_excess_s)
        else:  # a large job's digest: this node's ranks and the busiest, against all the job's
            slow = detectors.find_slow_among(busy, job.busy_stats, self.config.slow_ratio,
                                             self.config.slow_min_excess_s)
        slow_ranks = {s.rank for s in slow}
        for rank in list(self._slow_since):
            if rank not in slow_ranks:
                del self._slow_since[rank]
        for finding in slow:
            since = self._slow_since.setdefault(finding.rank, now)
            key = f"slow:{finding.rank}"
            if (now - since) / 1e9 < self.config.slow_confirm_s or key in self._reported:
                continue
            local = finding.rank in local_busy
            if not local and not leader:
                continue  # reported by the rank's own node and by the leader
            self._reported.add(key)
            node = node_of.get(finding.rank, "")
            message = (f"slow rank {finding.rank} on {node}: busy {finding.busy_s * 1e3:.0f} ms "
                       f"per step vs peers' median {finding.peers_median_s * 1e3:.0f} ms "
                       f"(x{finding.ratio:.1f})")
            self.emit("slow_rank", message, rank=finding.rank, node=node,
                      busy_s=finding.busy_s, peers_median_s=finding.peers_median_s,
                      ratio=finding.ratio, busy_by_rank={str(r): v for r, v in busy.items()},
                      node_by_rank={str(r): n for r, n in node_of.items()}, reported_by=here,
                      ranks_compared=(len(busy) if job.busy_stats is None
                                      else job.busy_stats.count))
            # Only the rank's own node acts on it: its restart restarts the whole job anyway.
            if self.config.slow_action == "restart" and local:
                return Detection(FailureClass.SLOW, (finding.rank,), "slow_rank", message)
        return None

    def _check_logs(self, group: GroupInfo, now: int) -> Detection | None:
        burst = self._log_scanner.scan(now / 1e9, group.node_id)
        if burst is not None and burst.errors_in_window >= self.config.diag_log_threshold \
                and "log" not in self._reported:
            self._reported.add("log")
            self.emit("log_errors", f"{burst.errors_in_window} error lines in "
                      f"{burst.window_s:g} s; first on {burst.first_node}: {burst.first_line}",
                      errors=burst.errors_in_window, first_node=burst.first_node,
                      first_line=burst.first_line)
        return None


class DiagAddOn(AddOn[DiagMonitor]):
    """Diagnostics as an add-on of the agent (:class:`elasticft.addon.api.AddOn`)."""

    name: ClassVar[str] = "diag"

    def build(self, context: AddOnContext, built: Mapping[str, AgentCollaborator | None]
              ) -> DiagMonitor | None:
        """The monitor ``elasticft-run`` uses, or None when diagnostics are off."""
        options = context.options
        config = options.diag
        if not config.diag_enabled:
            return None
        shim = None
        if config.diag_nccl_shim != "off":
            library = shim_library()
            if config.diag_nccl_shim == "on" and library is None:
                logger.warning("--diag-nccl-shim on, but the shim library was not built; "
                               "reinstall elasticft with a C compiler available")
            if library is not None and (config.diag_nccl_shim == "on" or health.gpu_present()):
                shim = library
        logs_specs = context.launch.logs_specs
        log_root = getattr(logs_specs, "root_log_dir", None) if logs_specs is not None else None
        metrics = None
        if config.diag_metrics is not None:
            metrics = DiagMetrics()
            metrics.serve(config.diag_metrics.host, config.diag_metrics.port,
                          config.diag_metrics_token)
        monitor = DiagMonitor(config, base_env=context.env, events=context.events,
                              event_dir=options.agent.event_dir,
                              log_root=Path(log_root) if log_root else None, nccl_shim=shim,
                              metrics=metrics)
        if metrics is not None:
            metrics.recent_collectives = monitor.recent_collective_durations
        return monitor
