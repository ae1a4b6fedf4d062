"""Slurm: node order from the allocation, and the three ways a Slurm job ends early.

A job on a Slurm cluster meets its time limit, a ``scancel``, or a bug in the user's code. Each
gets one answer here, inside the launcher, so the training script does not have to know Slurm:

* **The time limit.** Submitted with ``#SBATCH --signal=B:USR1@120``, the job's batch shell (the
  ``exec``'d ``elasticft-run``) gets SIGUSR1 120 s before the limit. The agent's handler only
  records it; the next monitor tick (:meth:`SlurmHandler.check`) asks the workers to checkpoint
  now: through the checkpoint service's "checkpoint now and wait for the ack" when the job uses
  the worker API, otherwise by forwarding the signal to every worker (a plain script saves on it
  and exits; see ``examples/train_plain.py``). It waits until the checkpoint is durable (the ack,
  or every worker has exited), requeues the job (``scontrol requeue $SLURM_JOB_ID``, or a new
  ``sbatch`` of the job's script from the first node) and ends the run with state ``requeued``
  and exit code 0. The next allocation starts the same command, which resumes from that
  checkpoint. A requeue ends the whole allocation, so on several nodes only the round's first
  node requeues, once every node has said in the round's store that its save is over. Whether a
  ``scontrol requeue`` that failed was done anyway (Slurm's SIGTERM ended scontrol with the
  allocation) is read from the job's restart count.
  The signal can come before the handler exists (a requeued job whose time is almost spent,
  a torch import that takes a minute from a shared file system): from the launcher's first
  line (:func:`hold_time_limit_signals`, before torch is imported) SIGUSR1 and SIGUSR2 are only
  recorded, and the handler takes over what came meanwhile; a held signal that is not the
  job's time-limit signal is delivered again then, as it would have been.
* **scancel** (SIGTERM to every process of the job). torch's handler stops the workers and the
  launcher exits with 143. This module only logs it as a cancel and records it; it saves first
  only with ``--slurm-save-on-cancel``, and never resubmits.
* **A user-code error, or a failure that repeated before the first step.** The policy stops the
  run (exit 1) with ``Action.fails_again``; the checkpoint service flushes what it holds; nothing
  is resubmitted: the same code would fail the same way.

The handler for the time-limit signal never does work itself: a Python handler runs between
bytecodes of the agent's main thread, which here is the monitor loop, so the work happens in
``check()`` where the agent is in a known state.

Node rank and order come from the allocation (:func:`torchrun_defaults`): ``SLURM_PROCID`` (one
``srun`` task per node) or ``SLURM_NODEID`` gives ``--node-rank``, the first host of
``SLURM_JOB_NODELIST`` gives ``--master-addr`` and the c10d endpoint, ``SLURM_JOB_NUM_NODES``
gives ``--nnodes`` and ``SLURM_JOB_ID`` the rendezvous id. Flags the user gives always win.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import re
import shlex
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, ClassVar, Protocol

from elasticft.addon.api import (
    AddOn,
    AddOnContext,
    AgentCollaborator,
    GroupInfo,
    StopRun,
    run_ending_errors,
)
from elasticft.addon.policy import Action, ActionKind
from elasticft.addon.savenow import CheckpointNow, SaveBeforeExit
from elasticft.config import ConfigError, SlurmConfig
from elasticft.events import EventLog

logger = logging.getLogger(__name__)

# Fraction of the signal's lead time the checkpoint may take; the rest is for the requeue.
SAVE_SHARE_OF_LEAD_TIME = 0.8
# How long past its own save deadline the first node waits for the others' saves.
REQUEUE_WAIT_S = 5.0
DEFAULT_C10D_PORT = 29400


# ----------------------------------------------------------------------------------------------
# The time-limit signal before the handler exists.

HELD_SIGNALS = (signal.SIGUSR1, signal.SIGUSR2)
"""The signals a job's ``--signal`` names in practice; both would end the launcher unhandled."""
_held_since: dict[signal.Signals, float | None] = {}
"""Each held signal and when it first came (``time.monotonic``; None: not yet)."""


def hold_time_limit_signals(env: Mapping[str, str]) -> None:
    """In a Slurm job, records :data:`HELD_SIGNALS` instead of dying of them until
    :func:`release_held_signals` (call first thing, on the main thread; a signal whose handler
    is not the default one is left alone)."""
    if SlurmEnv.from_env(env) is None or threading.current_thread() is not threading.main_thread():
        return
    for sig in HELD_SIGNALS:
        if sig not in _held_since and signal.getsignal(sig) is signal.SIG_DFL:
            _held_since[sig] = None
            signal.signal(sig, _record_held)


def _record_held(signum: int, frame: Any) -> None:
    sig = signal.Signals(signum)
    if sig in _held_since and _held_since[sig] is None:  # the first time it came counts
        _held_since[sig] = time.monotonic()


def release_held_signals(keep: signal.Signals | None = None) -> float | None:
    """Ends the hold. Returns how long ago ``keep`` came (None: it did not come), whose handler
    the caller installs; every other held signal gets its default action back, and one that came
    is sent again now (it ends the launcher, as it would have when it came)."""
    came: float | None = None
    for sig, at in list(_held_since.items()):
        del _held_since[sig]
        if sig == keep:
            came = None if at is None else time.monotonic() - at
            continue
        if signal.getsignal(sig) is _record_held:
            signal.signal(sig, signal.SIG_DFL)
            if at is not None:
                logger.warning("%s came during start-up and is not the time-limit signal; "
                               "it ends the launcher now", sig.name)
                os.kill(os.getpid(), sig)
    return came


# ----------------------------------------------------------------------------------------------
# The allocation.


@dataclasses.dataclass(frozen=True)
class SlurmEnv:
    """What Slurm tells a job about itself, read once from the environment."""

    job_id: str
    nodes: tuple[str, ...]
    """Hosts of the allocation in Slurm's order (SLURM_JOB_NODELIST expanded)."""
    procid: int | None
    nodeid: int | None
    restart_count: int
    """SLURM_RESTART_COUNT: how many times this job id has been requeued."""

    @property
    def node_rank(self) -> int:
        # SLURM_PROCID is the node's index when srun starts one task per node; in a batch
        # script (no srun) only SLURM_NODEID is meaningful, and it is 0 on the batch host.
        if self.procid is not None and self.procid < len(self.nodes):
            return self.procid
        return self.nodeid or 0

    @property
    def master_addr(self) -> str:
        return self.nodes[0] if self.nodes else "127.0.0.1"

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> SlurmEnv | None:
        job_id = env.get("SLURM_JOB_ID") or env.get("SLURM_JOBID")
        if not job_id:
            return None
        nodelist = env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST") or ""
        return cls(
            job_id=job_id,
            nodes=expand_nodelist(nodelist),
            procid=_int_or_none(env.get("SLURM_PROCID")),
            nodeid=_int_or_none(env.get("SLURM_NODEID")),
            restart_count=_int_or_none(env.get("SLURM_RESTART_COUNT")) or 0,
        )


def _int_or_none(value: str | None) -> int | None:
    try:
        return int(value) if value not in (None, "") else None
    except ValueError:
        return None


def _split_top_level(text: str) -> list[str]:
    parts, depth, current = [], 0, []
    for ch in text:
        if ch == "[":
            depth += 1
        elif ch == "]":
            depth -= 1
        if ch == "," and depth == 0:
            parts.append("".join(current))
            current = []
        else:
            current.append(ch)
    parts.append("".join(current))
    return [p for p in (s.strip() for s in parts) if p]


def _expand_range_set(spec: str) -> list[str]:
    values = []
    for item in spec.split(","):
        lo, sep, hi = item.partition("-")
        if not sep:
            values.append(lo)
            continue
        width = len(lo)
        values.extend(str(i).zfill(width) for i in range(int(lo), int(hi) + 1))
    return values


def expand_nodelist(nodelist: str) -> tuple[str, ...]:
    """``"gpu[01-03,7],login"`` -> ``("gpu01", "gpu02", "gpu03", "gpu7", "login")``.

    Slurm's host-list syntax (what ``scontrol show hostnames`` prints), including zero padding
    and several bracket groups in one name; order is kept.
    """
    hosts: list[str] = []
    for expression in _split_top_level(nodelist):
        expanded = [""]
        for literal, ranges in re.findall(r"([^\[]*)(?:\[([^\]]*)\])?", expression):
            if not literal and not ranges:
                continue
            options = _expand_range_set(ranges) if ranges else [""]
            expanded = [prefix + literal + o for prefix in expanded for o in options]
        hosts.extend(expanded)
    return tuple(hosts)


def _given(argv: Sequence[str], env: Mapping[str, str], flags: Sequence[str], pet: str) -> bool:
    for token in argv:
        name = token.split("=", 1)[0]
        if name in flags:
            return True
    return pet in env


def _launcher_argv(args: Any, argv: Sequence[str]) -> list[str]:
    script = getattr(args, "training_script", None)
    return list(argv[: argv.index(script)] if script in argv else argv)


def node_defaults(
    args: Any, argv: Sequence[str], env: Mapping[str, str], slurm: SlurmEnv
) -> dict[str, Any]:
    """Fills torchrun's node flags the user left out from the allocation; returns what it set.

    Call before torchrun's own defaults (which turn a single-node static run into a local c10d
    one). ``args`` is torchrun's parsed namespace; a flag counts as given when it is on the
    command line before the training script or in its ``PET_*`` variable.
    """
    given_argv = _launcher_argv(args, argv)
    changed: dict[str, Any] = {}

    def fill(attr: str, flags: Sequence[str], pet: str, value: Any) -> None:
        if not _given(given_argv, env, flags, pet):
            setattr(args, attr, value)
            changed[attr] = value

    nnodes = len(slurm.nodes) or 1
    fill("nnodes", ("--nnodes",), "PET_NNODES", str(nnodes))
    if nnodes > 1:
        fill("node_rank", ("--node-rank", "--node_rank"), "PET_NODE_RANK", slurm.node_rank)
        fill("master_addr", ("--master-addr", "--master_addr"), "PET_MASTER_ADDR",
             slurm.master_addr)
        if getattr(args, "rdzv_backend", "static") != "static":
            fill("rdzv_endpoint", ("--rdzv-endpoint", "--rdzv_endpoint"), "PET_RDZV_ENDPOINT",
                 f"{slurm.master_addr}:{DEFAULT_C10D_PORT}")
    return changed


def run_id_default(
    args: Any, argv: Sequence[str], env: Mapping[str, str], slurm: SlurmEnv
) -> str | None:
    """One run id per Slurm job, so the run directory (and the report) spans its requeues.

    Call after torchrun's defaults, which give a single-node run a random id; the user's
    ``--rdzv-id`` wins.
    """
    if _given(_launcher_argv(args, argv), env, ("--rdzv-id", "--rdzv_id"), "PET_RDZV_ID"):
        return None
    args.rdzv_id = f"slurm-{slurm.job_id}"
    return args.rdzv_id


def detect(config: SlurmConfig, env: Mapping[str, str]) -> SlurmEnv | None:
    """The allocation when the Slurm integration applies, else None."""
    if config.slurm_mode == "off":
        return None
    slurm = SlurmEnv.from_env(env)
    if slurm is None and config.slurm_mode == "on":
        raise ConfigError(
            "--slurm-mode=on but SLURM_JOB_ID is not set; run inside a Slurm job or use auto",
            reason="not_in_slurm",
        )
    return slurm


# ----------------------------------------------------------------------------------------------
# Talking to Slurm.


class CommandRunner(Protocol):
    def __call__(self, cmd: Sequence[str], timeout: float) -> subprocess.CompletedProcess: ...


def run_command(cmd: Sequence[str], timeout: float) -> subprocess.CompletedProcess:
    return subprocess.run(list(cmd), capture_output=True, text=True, timeout=timeout, check=False)


def job_fields(text: str) -> dict[str, str]:
    """Parses one ``scontrol -o show job`` line into its Key=Value fields."""
    fields: dict[str, str] = {}
    key = None
    for token in text.strip().split(" "):
        name, sep, value = token.partition("=")
        if sep and re.fullmatch(r"[A-Za-z][\w/:]*", name):
            key = name
            fields[key] = value
        elif key is not None:
            # A value with spaces (Command with arguments, a path) continues the last field.
            fields[key] += " " + token
    return fields


def requeue_command(
    how: str, slurm: SlurmEnv, script: Path | None, runner: CommandRunner
) -> list[str]:
    """The command that hands the job back to Slurm."""
    if how == "scontrol":
        return ["scontrol", "requeue", slurm.job_id]
    shown = runner(["scontrol", "-o", "show", "job", slurm.job_id], 30)
    fields = job_fields(shown.stdout) if shown.returncode == 0 else {}
    workdir = fields.get("WorkDir")
    command = str(script) if script else fields.get("Command")
    if not command:
        raise RuntimeError(
            f"cannot find job {slurm.job_id}'s script to resubmit (no Command in scontrol show "
            "job); use --slurm-requeue scontrol"
        )
    cmd = ["sbatch", "--parsable"]
    if workdir:
        cmd.append(f"--chdir={workdir}")
    return cmd + shlex.split(command)


# ----------------------------------------------------------------------------------------------
# The agent's side.


@dataclasses.dataclass(eq=False)
class SlurmHandler(AgentCollaborator):
    """The agent's answer to Slurm's time-limit signal and cancel (see the module docstring)."""

    config: SlurmConfig
    slurm: SlurmEnv
    _: dataclasses.KW_ONLY
    event_dir: Path | None = None
    """The ``slurm`` event log goes below it (None: the run directory, known at rendezvous)."""
    node_id: str = ""
    checkpointer: CheckpointNow | None = None
    runner: CommandRunner = run_command
    clock: Callable[[], float] = time.monotonic
    poll_interval: float = 0.1
    """Seconds between checks of whether the signalled workers have exited."""

    def __post_init__(self) -> None:
        self.signal = self.config.slurm_signal.signal
        self._events: EventLog | None = None
        self._signalled_at: float | None = None
        self._signal_seen = threading.Event()
        self._handled = False
        self._torch_term_handler: Any = None
        self._saver = SaveBeforeExit(self.checkpointer, self.clock, self.poll_interval)
        self.outcome: str | None = None
        """What ended the run from Slurm's side: requeued, cancelled (None while running)."""
        self._store: Any = None
        """The rendezvous round's store: the nodes' saves meet there before the requeue."""

    # -- set-up ---------------------------------------------------------------------------------

    def install(self) -> None:
        """Installs the time-limit signal handler; call from the launcher's main thread."""
        signal.signal(self.signal, self._on_signal)
        logger.info(
            "Slurm job %s (restart %d, nodes %s): %s means the time limit is %gs away",
            self.slurm.job_id, self.slurm.restart_count, ",".join(self.slurm.nodes),
            self.signal.name, self.config.slurm_signal.lead_time.total_seconds(),
        )
        ago = release_held_signals(keep=self.signal)
        if ago is not None:
            logger.warning("%s came %.1fs ago, while the launcher started: the time-limit "
                           "checkpoint comes as soon as the workers run", self.signal.name, ago)
            self._signalled_at = self.clock() - ago
            self._signal_seen.set()

    def _on_signal(self, signum: int, frame: Any) -> None:
        # Runs between bytecodes of the agent's main thread: record only, act in check().
        if self._signalled_at is None:
            self._signalled_at = self.clock()
        self._signal_seen.set()

    def _emit(self, kind: str, **payload: Any) -> None:
        if self._events is None and self.event_dir is not None:
            # A file of its own (a subdirectory of the event dir): never interleaves with the
            # agent's writes; read_events merges them.
            self._events = EventLog(self.event_dir / "slurm", self.node_id or "node")
        if self._events is not None:
            self._events.emit(kind, job_id=self.slurm.job_id, **payload)

    # -- hooks ----------------------------------------------------------------------------------

    def on_rendezvous(self, group: GroupInfo, store: Any) -> None:
        self._store = store

    def on_workers_started(self, group: GroupInfo) -> None:
        if self.event_dir is None:
            self.event_dir = group.run_dir
            self.node_id = self.node_id or group.node_id
        if not self._handled:
            self._emit("slurm_allocation", restart_count=self.slurm.restart_count,
                       nodes=list(self.slurm.nodes), node_rank=self.slurm.node_rank)
            self._handled = True
        # torch's process context (re)installs its SIGTERM handler at every start; wrap it so
        # a cancel is logged as one (and checkpointed when asked) before torch stops the run.
        current = signal.getsignal(signal.SIGTERM)
        if current is not self._on_term:
            self._torch_term_handler = current
            signal.signal(signal.SIGTERM, self._on_term)
        self._group = group

    def check(self, group: GroupInfo) -> None:
        if self._signal_seen.is_set() and self.outcome is None:
            self._time_limit(group)
        return None

    def on_decision(self, group: GroupInfo, action: Action) -> None:
        if action.kind is ActionKind.STOP and action.fails_again:
            logger.error("Slurm job %s stops on a failure that would come back; it is not "
                         "resubmitted (%s)", self.slurm.job_id, action.reason)
            self._emit("slurm_no_resubmit", reason=action.reason)

    def close(self) -> None:
        if self._events is not None:
            self._events.close()

    # -- the time limit -------------------------------------------------------------------------

    def _time_limit(self, group: GroupInfo) -> None:
        lead = self.config.slurm_signal.lead_time.total_seconds()
        signalled = self._signalled_at if self._signalled_at is not None else self.clock()
        deadline = signalled + SAVE_SHARE_OF_LEAD_TIME * lead
        logger.warning(
            "Slurm time limit in about %gs (%s): checkpointing, then requeue (%s)",
            lead, self.signal.name, self.config.slurm_requeue,
        )
        self._emit("slurm_time_limit", signal=self.signal.name, lead_time_s=lead,
                   signalled_s_ago=round(self.clock() - signalled, 3))
        started = self.clock()
        durable, how = self._saver.save(group, deadline, self.signal, "slurm time limit")
        save_s = self.clock() - started
        self._emit("slurm_checkpoint", durable=durable, how=how, duration_s=save_s)
        if not durable:
            logger.error("the time-limit checkpoint was not confirmed (%s); the next allocation "
                         "resumes from the last periodic checkpoint", how)
        # From here on Slurm's SIGTERM (sent to the whole job by the requeue) is expected.
        signal.signal(signal.SIGTERM, self._after_requeue_term)
        reason = f"Slurm time limit: checkpoint {'durable' if durable else 'NOT confirmed'} " \
                 f"({how}, {save_s:.1f}s)"
        if self.config.slurm_requeue == "off":
            self.outcome = "stopped"
            self._emit("slurm_requeue", how="off", ok=False)
            raise StopRun("time_limit", reason + "; requeue is off", exit_code=0)
        if not self._leads_requeue(group, durable, deadline + REQUEUE_WAIT_S):
            self.outcome = "requeued"
            self._emit("slurm_requeue", how=self.config.slurm_requeue, ok=True,
                       detail="left to the round's first node")
            raise StopRun("requeued", f"{reason}; the round's first node requeues the job",
                          exit_code=0)
        ok, detail = self._requeue()
        self.outcome = "requeued" if ok else "requeue_failed"
        self._emit("slurm_requeue", how=self.config.slurm_requeue, ok=ok, detail=detail)
        if not ok:
            raise StopRun("failed", f"{reason}; requeue failed: {detail}", exit_code=1)
        raise StopRun("requeued", f"{reason}; requeued ({detail})", exit_code=0)

    def _leads_requeue(self, group: GroupInfo, durable: bool, wait_until: float) -> bool:
        """Whether this node requeues the job. Slurm ends the whole allocation at the first
        requeue, so on several nodes only the round's first node requeues, once every node has
        said its save is over (or at ``wait_until``): a node still saving is not cut short.
        Without the round's store each node requeues for itself: a second ``scontrol
        requeue`` is judged by the job's restart count, but a second ``sbatch`` would be a
        second job, so that one is the allocation's first node's alone."""
        on_its_own = self.config.slurm_requeue != "sbatch" or self.slurm.node_rank == 0
        if self._store is None or group.group_world_size < 2:
            return on_its_own
        keys = [_saved_key(group.round, r) for r in range(group.group_world_size)]
        try:
            self._store.set(keys[group.group_rank], "durable" if durable else "not confirmed")
            if group.group_rank != 0:
                return False
            while not self._store.check(keys) and self.clock() < wait_until:
                time.sleep(self.poll_interval)
            missing = [r for r, key in enumerate(keys) if not self._store.check([key])]
        except run_ending_errors():
            raise
        except Exception as e:  # the store went with its host
            logger.warning("the nodes' saves could not meet in the round's store (%s: %s); "
                           "each node requeues on its own", type(e).__name__, e)
            return on_its_own
        self._emit("slurm_nodes_saved", nodes=group.group_world_size, missing=missing)
        if missing:
            logger.error("node ranks %s did not say their save was over by the deadline; "
                         "requeueing all the same", missing)
        return True

    def _requeue(self) -> tuple[bool, str]:
        try:
            cmd = requeue_command(self.config.slurm_requeue, self.slurm,
                                  self.config.slurm_resubmit_script, self.runner)
            done = self.runner(cmd, 60)
        except (OSError, RuntimeError, subprocess.TimeoutExpired) as e:
            return False, str(e)
        text = " ".join(cmd)
        if done.returncode != 0:
            failed = f"`{text}` exited {done.returncode}: {done.stderr.strip()}"
            restarts = self._restarts() if self.config.slurm_requeue == "scontrol" else None
            if restarts is None or restarts <= self.slurm.restart_count:
                return False, failed
            # Slurm answers a requeue by ending the allocation: its SIGTERM reaches every
            # process of the job, scontrol too when it has not exited yet (exit -15); on several
            # nodes another node's agent may have requeued it first. The job's restart count
            # says whether it was requeued.
            logger.warning("%s, but job %s shows Restarts=%d: it was requeued", failed,
                           self.slurm.job_id, restarts)
            return True, f"`{text}` exited {done.returncode}, yet Restarts={restarts}: requeued"
        logger.warning("requeued: `%s` %s", text, done.stdout.strip())
        return True, f"`{text}`" + (f" -> job {done.stdout.strip()}" if done.stdout.strip() else "")

    def _restarts(self) -> int | None:
        """How many times Slurm has requeued this job, as it says now (None: unknown)."""
        try:
            shown = self.runner(["scontrol", "-o", "show", "job", self.slurm.job_id], 30)
            return int(job_fields(shown.stdout)["Restarts"]) if shown.returncode == 0 else None
        except (OSError, subprocess.TimeoutExpired, KeyError, ValueError):
            return None

    # -- cancel ---------------------------------------------------------------------------------

    def _on_term(self, signum: int, frame: Any) -> None:
        if self.outcome is None:
            self.outcome = "cancelled"
            logger.warning("Slurm job %s got SIGTERM (scancel or the hard time limit): stopping "
                           "%s; not resubmitting", self.slurm.job_id,
                           "after a checkpoint" if self.config.slurm_save_on_cancel
                           else "without a checkpoint")
            self._emit("slurm_cancel", save=self.config.slurm_save_on_cancel)
            if self.config.slurm_save_on_cancel and self.checkpointer is not None:
                # Slurm's SIGKILL follows after KillWait (30 s by default).
                try:
                    self.checkpointer.checkpoint_now("slurm cancel", 20.0)
                except Exception:
                    logger.exception("checkpoint on cancel failed")
        handler = self._torch_term_handler
        if callable(handler):
            handler(signum, frame)  # torch's: raises SignalException, the launcher stops
        else:
            signal.signal(signal.SIGTERM, handler if handler is not None else signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGTERM)

    def _after_requeue_term(self, signum: int, frame: Any) -> None:
        logger.info("SIGTERM after the requeue (Slurm ends this allocation); exiting")


class SlurmAddOn(AddOn[SlurmHandler]):
    """The Slurm handler as an add-on of the agent (:class:`elasticft.addon.api.AddOn`); None
    outside Slurm. It needs the checkpoint service, when there is one, for the time-limit
    checkpoint. Built on the main thread (signal handlers can only be installed there)."""

    name: ClassVar[str] = "slurm"
    needs: ClassVar[tuple[str, ...]] = ("ckpt",)

    def build(self, context: AddOnContext, built: Mapping[str, AgentCollaborator | None]
              ) -> SlurmHandler | None:
        options = context.options
        slurm = detect(options.slurm, context.env)
        if slurm is None:
            release_held_signals()
            return None
        checkpoints = built["ckpt"]
        handler = SlurmHandler(
            options.slurm,
            slurm,
            event_dir=options.agent.event_dir,
            node_id=options.agent.node_id or "",
            checkpointer=checkpoints if isinstance(checkpoints, CheckpointNow) else None,
        )
        handler.install()
        return handler


def _saved_key(round_: int, group_rank: int) -> str:
    return f"elasticft.slurm.{round_}.saved.{group_rank}"
