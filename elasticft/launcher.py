"""Launching one node's agent: elasticft's counterpart of torch's ``elastic_launch``.

:func:`launch` takes torch's own :class:`LaunchConfig` (so anything that builds one for
``elastic_launch`` works here) plus elasticft's options and collaborators, runs an
:class:`ElasticftAgent`, and returns a :class:`LaunchResult` instead of raising: the caller
decides how to report it. It differs from torch's ``launch_agent`` where torch 2.13 falls short:

* workers get a fresh store every attempt (``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``), so
  restarts never meet a previous attempt's gloo addresses (pytorch#135712);
* a failed or unhealthy group ends with a non-zero exit code and the reason, never with 0;
* the rendezvous is closed for everyone only when the job is done (success, or a job-wide stop);
  a node that leaves or is signalled does not take the other nodes down.

Workers started by :func:`launch` get what ``elasticft-run`` gives them unless the caller asked
otherwise: the default add-ons (:func:`default_add_ons`; ``add_ons=()`` runs without them, and
``collaborators`` come after them), stderr teed to a file so that a failure's traceback can be
classified (:func:`worker_logs`), their log files in the run directory, the warm pool, and for a
function entrypoint the recorder bootstrap (:class:`elasticft.diag.autoinstall.ArmedEntrypoint`)
that a script gets from ``sitecustomize``; its exception reaches the agent through torch's error
file, as a script's does through the captured stream.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import signal
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

from elasticft import home, procs
from elasticft.addon.api import AddOn, AddOnContext, AgentCollaborator, StopRun
from elasticft.addon.classify import FailureRecord
from elasticft.addon.policy import ActionKind
from elasticft.agent import lifeline
from elasticft.agent.addons import build_add_ons
from elasticft.agent.agent import ElasticftAgent
from elasticft.agent.warmpool import WarmPool
from elasticft.config import (
    ElasticftConfig,
    checkpoint_dir_default,
    require_writable_dir,
    run_dir_default,
)
from elasticft.diag.autoinstall import ArmedEntrypoint
from elasticft.events import EVENT_FILE_GLOB, EventLog
from elasticft.rendezvous.handler import DISABLE_SHARED_STORE_ENV
from elasticft.rendezvous.identity import claim_node_id
from elasticft.torch_compat import (
    DefaultLogsSpecs,
    LaunchConfig,
    LogsSpecs,
    RendezvousError,
    RendezvousParameters,
    SignalException,
    Std,
    default_logs_streams,
    metrics,
    parse_rendezvous_endpoint,
    rdzv_registry,
    shutdown_timeout_of,
    stop_rendezvous_heartbeats,
    torch_events,
    worker_spec,
)

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class LaunchResult:
    """How one node's run ended."""

    exit_code: int
    state: str
    """succeeded | failed | stopped (signal) | left (this node left the job)."""
    reason: str
    run_id: str
    run_dir: Path
    event_log: Path
    restarts: int
    failures: tuple[FailureRecord, ...]
    wall_time_s: float
    return_values: dict[int, Any] = dataclasses.field(default_factory=dict)

    def summary(self) -> str:
        lines = [
            f"elasticft: run {self.run_id} {self.state} (exit code {self.exit_code}) after "
            f"{self.wall_time_s:.1f} s with {self.restarts} restart(s)",
        ]
        if self.reason:
            lines.append(f"  reason: {self.reason}")
        for failure in self.failures:
            lines.append(f"  failure: {failure.summary()}")
        lines.append(f"  events: {self.event_log}")
        return "\n".join(lines)


def default_run_dir(options: ElasticftConfig, config: LaunchConfig) -> Path:
    log_dir = getattr(config.logs_specs, "root_log_dir", None) if config.logs_specs else None
    return run_dir_default(options.agent.run_dir, log_dir, str(config.run_id))


def default_add_ons() -> list[AddOn[Any]]:
    """The add-ons ``elasticft-run`` gives its agent, one per subsystem; their declarations order
    them (:mod:`elasticft.agent.addons`). Imported here so that a launcher with none of them
    loads none."""
    from elasticft.agent.steplog import StepLogAddOn
    from elasticft.ckpt.service import CheckpointAddOn
    from elasticft.diag.monitor import DiagAddOn
    from elasticft.plan.collaborator import LayoutAddOn
    from elasticft.preemption.handler import PreemptionAddOn
    from elasticft.recovery.orchestrator import RecoveryAddOn
    from elasticft.slurm import SlurmAddOn

    return [LayoutAddOn(), StepLogAddOn(), DiagAddOn(), RecoveryAddOn(), CheckpointAddOn(),
            SlurmAddOn(), PreemptionAddOn()]


def with_stderr_teed(redirects: Std | dict[int, Std], tee: Std | dict[int, Std],
                     nproc: int) -> Std | dict[int, Std]:
    """``tee`` with stderr added for each local rank whose stderr is neither redirected nor
    teed already (pure). Teeing changes nothing on the console: the stream is still shown there,
    and copied to a file."""
    def at(value: Std | dict[int, Std], rank: int) -> Std:
        return value if isinstance(value, Std) else value.get(rank, Std.NONE)

    def teed(rank: int) -> Std:
        shown = at(tee, rank)
        return shown if (at(redirects, rank) | shown) & Std.ERR else shown | Std.ERR

    if isinstance(redirects, Std) and isinstance(tee, Std):
        return teed(0)
    return {rank: teed(rank) for rank in range(nproc)}


def _torch_temporary_dir(log_dir: str) -> bool:
    """Whether ``log_dir`` is one torch made itself for a LaunchConfig without a log directory
    (a new /tmp/torchelastic_* that nobody removes)."""
    path = Path(log_dir)
    return path.parent == Path(tempfile.gettempdir()) and path.name.startswith("torchelastic_")


def worker_logs(specs: LogsSpecs | None, run_dir: Path, nproc: int, capture_stderr: bool
                ) -> LogsSpecs:
    """The workers' logs as ``elasticft-run`` keeps them: in ``<run-dir>/logs`` instead of torch's
    temporary directory, and every rank's stderr copied to a file (``capture_stderr``). A
    caller's own log directory, redirects and tee are kept (stderr is added to a rank's tee only
    where it went to neither), and so is a ``LogsSpecs`` of another kind than torch's default."""
    if specs is None:
        specs = DefaultLogsSpecs(str(run_dir / "logs"))
    fields = default_logs_streams(specs)
    if fields is None or fields[0] == os.devnull:
        return specs
    log_dir, redirects, tee, ranks_filter = fields
    new_dir, new_tee = log_dir, tee
    if _torch_temporary_dir(log_dir):
        new_dir = str(run_dir / "logs")
        with contextlib.suppress(OSError):
            os.rmdir(log_dir)  # empty: torch made it for these specs, nothing ran yet
    if capture_stderr:
        new_tee = with_stderr_teed(redirects, tee, nproc)
    if (new_dir, new_tee) == (log_dir, tee):
        return specs
    return DefaultLogsSpecs(new_dir, redirects, new_tee, ranks_filter)


def sweep_leftovers(options: ElasticftConfig) -> None:
    """Removes what agents of this user that are gone (SIGKILLed) left in shared memory: their
    progress rings and checkpoint segments. The one place that sweeps: every start does it,
    whichever subsystems it runs; another user's files and those of live processes are never
    touched."""
    from elasticft.ckpt.memory import shm
    from elasticft.diag.workerenv import default_ring_base, sweep_dead_ring_dirs

    rings = sweep_dead_ring_dirs(Path(options.diag.diag_ring_dir or default_ring_base()))
    if rings:
        logger.info("removed %d ring directories of agents that are gone", len(rings))
    if shm.SHM_DIR.is_dir():
        shm.sweep_orphans(shm.SHM_DIR)


@contextlib.contextmanager
def _signals_noted() -> Iterator[list[int]]:
    """While the launcher cleans up, SIGTERM, SIGINT and SIGHUP are noted, not raised.

    A second signal (scancel signals every process of a step, a user presses Ctrl-C twice, one
    arrived while torch was stopping the workers) raised torch's ``SignalException`` in the
    middle of closing the warm interpreters, the rendezvous or a collaborator: the launcher
    exited 1 with a traceback and left them half closed. The run had ended already; its
    outcome stands.
    """
    noted: list[int] = []
    previous: dict[int, Any] = {}
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            previous[sig] = signal.signal(sig, lambda signum, _frame: noted.append(signum))
    try:
        yield noted
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _master_addr_and_port(params: RendezvousParameters) -> tuple[str | None, int | None]:
    if params.backend != "static":
        return None, None
    endpoint = params.endpoint.strip()
    if not endpoint:
        raise ValueError("the static rendezvous needs --master-addr and --master-port")
    host, port = parse_rendezvous_endpoint(endpoint, default_port=-1)
    if port == -1:
        raise ValueError(f"port is missing in endpoint {endpoint}; give --master-port")
    return host, port


def launch(
    config: LaunchConfig,
    entrypoint: Callable[..., Any] | str,
    args: Sequence[Any],
    options: ElasticftConfig | None = None,
    *,
    collaborators: Sequence[AgentCollaborator] = (),
    add_ons: Sequence[AddOn[Any]] | None = None,
    agent_class: type[ElasticftAgent] = ElasticftAgent,
) -> LaunchResult:
    """Runs this node's agent until the job ends for it; never raises for worker failures.

    ``add_ons``: the subsystems the agent runs, :func:`default_add_ons` when None (``()``: none
    of them). ``collaborators`` are added after them. A :class:`ConfigError` names an option
    an add-on cannot use, before any worker starts.
    """
    options = options or ElasticftConfig()
    started = time.monotonic()
    if not config.run_id:
        config.run_id = str(uuid.uuid4().int)
    # A name no other live agent of this job on this host holds (elasticft-run has claimed it
    # already; claiming again in the same process is a no-op).
    claim = claim_node_id(str(config.run_id), options.agent.node_id,
                          endpoint=str(config.rdzv_endpoint or ""))
    node_id = claim.node_id
    run_dir = default_run_dir(options, config)
    require_writable_dir("--run-dir", run_dir, mode=0o700)
    lifeline.end_strays(str(config.run_id))
    # Every add-on knows this agent by the name it claimed, and the run by its directory.
    options = dataclasses.replace(options, agent=dataclasses.replace(
        options.agent, node_id=node_id, run_dir=run_dir))
    # Once the options are known to be usable (a usage error is the only line).
    earlier = sum(1 for _ in run_dir.glob(EVENT_FILE_GLOB))
    previous = home.previous_launch(run_dir) if earlier else None
    if options.agent.event_dir is not None:
        require_writable_dir("AgentConfig.event_dir", Path(options.agent.event_dir))
    # The agent's one event log: the add-ons get it from their context, the agent from here.
    event_log = EventLog(options.agent.event_dir or run_dir, node_id)
    try:
        collaborators = [
            *build_add_ons(default_add_ons() if add_ons is None else add_ons,
                           AddOnContext(options, config, os.environ, events=event_log,
                                        run_dir=run_dir)),
            *collaborators,
        ]
    except Exception:
        # Nothing started: the file goes with the usage error, and so does the claim.
        event_log.close()
        event_log.path.unlink(missing_ok=True)
        claim.release()
        raise
    # After every usage error (the add-ons check their options above), so that one stays the
    # only line even where gone agents left something to sweep.
    sweep_leftovers(options)
    logger.info("run %s, run directory %s%s", config.run_id, run_dir.absolute(),
                f" (a relaunch: {earlier} earlier agent(s) of this job ran there)"
                if earlier else "")
    script = home.script_path([str(a) for a in args])
    if previous is None and script is not None and options.ckpt.ckpt_dir is None:
        # Never a silent start from step 0 beside a checkpoint of the same script.
        for other, start, step in home.same_script_elsewhere(run_dir, script):
            logger.warning("%s", home.elsewhere_line(
                str(config.run_id), other, start, step, f"{config.min_nodes}:{config.max_nodes}",
                config.nproc_per_node))
    if previous is not None:
        ckpt_dir = checkpoint_dir_default(options.ckpt.ckpt_dir, run_dir).absolute()
        previous_args = [str(a) for a in previous.get("args") or ()]
        step = home.newest_checkpoint(ckpt_dir)
        logger.info("%s", home.relaunch_line(str(config.run_id), previous_args,
                                             [str(a) for a in args], step, ckpt_dir,
                                             fresh=options.agent.fresh,
                                             scripts=(previous.get("script"), script)))
        event_log.emit("relaunch", previous_args=previous_args, newest_step=step,
                       changed=home.changed_arguments(
                           home.script_arguments(previous_args),
                           home.script_arguments([str(a) for a in args])))
    if config.rdzv_backend == "static" and config.max_nodes > 1 and config.max_restarts > 0:
        # torch's static rendezvous has no rounds: a node that restarts meets the others' old
        # workers on the old store, and they never learn of it.
        logger.warning("the static rendezvous (--master-addr/--master-port across %d nodes) "
                       "cannot restart nodes together: a restart on one node leaves it and the "
                       "others waiting; use --rdzv-backend c10d or etcd-v3 for restarts across "
                       "nodes", config.max_nodes)
    logs_specs = worker_logs(config.logs_specs, run_dir, config.nproc_per_node,
                             options.agent.capture_stderr)
    if not options.agent.share_rdzv_store:
        os.environ.setdefault(DISABLE_SHARED_STORE_ENV, "1")
    os.environ["TORCHELASTIC_SIGNALS_TO_HANDLE"] = config.signals_to_handle

    entry_name = entrypoint if isinstance(entrypoint, str) else entrypoint.__name__
    if not isinstance(entrypoint, str):
        entrypoint = ArmedEntrypoint(entrypoint)
    event_log.emit(
        "run_start",
        run_id=config.run_id,
        entrypoint=entry_name,
        args=[str(a) for a in args],
        script=script,
        min_nodes=config.min_nodes,
        max_nodes=config.max_nodes,
        nproc_per_node=config.nproc_per_node,
        max_restarts=config.max_restarts,
        rdzv_backend=config.rdzv_backend,
        pid=os.getpid(),
        # When the launcher process began: its own start-up counts in the report's wall time.
        process_started=procs.started_at(os.getpid()),
    )
    params = RendezvousParameters(
        backend=config.rdzv_backend,
        endpoint=config.rdzv_endpoint,
        run_id=config.run_id,
        min_nodes=config.min_nodes,
        max_nodes=config.max_nodes,
        local_addr=config.local_addr,
        **config.rdzv_configs,
    )
    # The rendezvous (blacklist, membership) knows this node by the same name as the events.
    params.config.setdefault("node_id", node_id)
    master_addr, master_port = _master_addr_and_port(params)
    spec = worker_spec(
        role=config.role,
        local_world_size=config.nproc_per_node,
        entrypoint=entrypoint,
        args=tuple(args),
        rdzv_handler=rdzv_registry.get_rendezvous_handler(params),
        max_restarts=config.max_restarts,
        monitor_interval=config.monitor_interval,
        master_addr=master_addr,
        master_port=master_port,
        local_addr=config.local_addr,
        event_log_handler=config.event_log_handler,
        numa_options=getattr(config, "numa_options", None),
        duplicate_stdout_filters=getattr(config, "duplicate_stdout_filters", None),
        duplicate_stderr_filters=getattr(config, "duplicate_stderr_filters", None),
        virtual_local_rank=getattr(config, "virtual_local_rank", None),
    )
    # The rendezvous records the memberships it ends on evidence of a dead agent.
    if (set_event_sink := getattr(spec.rdzv_handler, "set_event_sink", None)) is not None:
        set_event_sink(event_log.emit)
    warm_pool = WarmPool(frameworks=options.agent.warm_frameworks) \
        if options.agent.warm_start else None
    agent = agent_class(
        spec,
        logs_specs,
        options=options,
        events=event_log,
        node_id=node_id,
        run_dir=run_dir,
        collaborators=collaborators,
        start_method=config.start_method,
        log_line_prefix_template=config.log_line_prefix_template,
        shutdown_timeout=shutdown_timeout_of(config),
        warm_pool=warm_pool,
    )

    close_rendezvous = False
    state, reason, exit_code, return_values = "failed", "", 1, {}
    try:
        metrics.initialize_metrics(metrics.MetricsConfig(config.metrics_cfg))
        result = agent.run()
        torch_events.record(agent.get_event_succeeded(), config.event_log_handler)
        if result is None:
            state, reason, exit_code = "left", "the rendezvous let this standby node go", 0
        elif result.is_failed():
            action = agent.final_action
            reason = action.reason if action else "worker group failed"
            exit_code = action.exit_code if action and action.exit_code else 1
            state = "left" if action and action.kind is ActionKind.EVICT_NODE else "failed"
            close_rendezvous = state == "failed"
        else:
            state, exit_code, return_values = "succeeded", 0, dict(result.return_values)
            close_rendezvous = True
    except StopRun as e:
        # A collaborator ended the run on purpose (a Slurm time-limit checkpoint and requeue, a
        # preemption's checkpoint); the agent has stopped the workers. Other nodes handle their
        # own signal.
        state, reason, exit_code = e.state, e.reason, e.exit_code
    except SignalException as e:
        # The launcher itself was signalled (scancel, Ctrl-C, kill): its workers are already
        # stopped by the agent; do not close the rendezvous for the other nodes.
        sig = signal.Signals(e.sigval)
        state, reason, exit_code = "stopped", f"received {sig.name}", 128 + int(sig)
    except RendezvousError as e:
        reason = f"rendezvous failed: {type(e).__name__}: {e}"
    finally:
        with _signals_noted() as late_signals:
            if close_rendezvous:
                spec.rdzv_handler.shutdown()
            else:
                _stop_heartbeats(spec.rdzv_handler)
            if warm_pool is not None:
                warm_pool.close()
            for collaborator in collaborators:
                try:
                    collaborator.close()
                except Exception:
                    logger.exception("collaborator %s failed to close",
                                     type(collaborator).__name__)
    if late_signals:
        # The run had already ended, and how stands: a Slurm requeue SIGTERMs the job it just
        # requeued, and that must not turn "requeued" into "stopped".
        logger.info("%s arrived while closing a run that had ended (%s); it changes nothing",
                    signal.Signals(late_signals[0]).name, state)
    wall = time.monotonic() - started
    event_log.emit(
        "run_end", state=state, exit_code=exit_code, reason=reason, restarts=agent.restarts,
        wall_time_s=wall,
    )
    event_log.close()
    claim.release()
    return LaunchResult(
        exit_code=exit_code,
        state=state,
        reason=reason,
        run_id=str(config.run_id),
        run_dir=run_dir,
        event_log=event_log.path,
        restarts=agent.restarts,
        failures=tuple(agent.failures),
        wall_time_s=wall,
        return_values=return_values,
    )


def _stop_heartbeats(handler: Any) -> None:
    # Leaving without closing: stop this node's keep-alives so the others drop it quickly.
    try:
        stop_rendezvous_heartbeats(handler)
    except Exception:
        logger.debug("could not stop rendezvous heartbeats", exc_info=True)
