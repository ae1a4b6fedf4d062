"""elasticft's own options, declared in one place.

Every option lives in a frozen dataclass of its subsystem (a *section*). Each field is declared
once, with :func:`option`, and that single declaration gives it

* a command-line flag ``--field-name`` on ``elasticft-run``,
* an environment variable ``ELASTICFT_FIELD_NAME``,
* a YAML key ``section: {field_name: ...}`` in the file given with ``--config``.

:mod:`elasticft.options` reads them (precedence CLI flag > ``ELASTICFT_*`` env > YAML file >
default). torchrun's own flags (and their ``PET_*`` variables) stay with torch's parser.

A value that cannot be used raises :class:`ConfigError`, whose message names the value, where it
came from and how to fix it, in one line.
"""

from __future__ import annotations

import dataclasses
import tempfile
from datetime import timedelta
from pathlib import Path
from typing import Any, Literal

ENV_PREFIX = "ELASTICFT_"
RUNS_DIR = Path("elasticft-runs")
"""Where runs go without --run-dir or --log-dir: ``RUNS_DIR/<run id>``, relative to the cwd."""


class ConfigError(ValueError):
    """A user-supplied option is unusable; ``reason`` is machine-readable."""

    def __init__(self, message: str, reason: str = "bad_option") -> None:
        super().__init__(message)
        self.reason = reason


def require_writable_dir(flag: str, directory: Path, mode: int = 0o777) -> None:
    """Creates ``directory`` and proves it writable, or raises a one-line :class:`ConfigError`.

    Run before anything starts: a directory found unwritable later would cost a run its event
    log or every checkpoint it meant to persist.
    """
    try:
        directory.mkdir(parents=True, exist_ok=True, mode=mode)
        # A file with no name (O_TMPFILE): a SIGKILL during the probe leaves nothing there.
        with tempfile.TemporaryFile(dir=directory):
            pass
    except OSError as e:
        raise ConfigError(f"{flag} {directory}: cannot write there ({e.strerror}); choose a "
                          "directory this user can create and write") from None


def option(default: Any, help: str, *, minimum: float | None = None) -> Any:
    """Declares a field of a config section with its help text (shown by ``--help``)."""
    return dataclasses.field(default=default, metadata={"help": help, "minimum": minimum})


# ----------------------------------------------------------------------------------------------
# Sections. Each subsystem owns one; field names are unique across sections because they become
# flat flag and env names.


@dataclasses.dataclass(frozen=True)
class AgentConfig:
    """How the node agent reacts to failures and where it records what happened."""

    restart_on_user_error: int = option(
        0,
        "How many times a failure caused by the user's code (SyntaxError, NameError, TypeError, "
        "assertion...) is restarted before the job stops. 0 stops at the first one.",
        minimum=0,
    )
    run_dir: Path | None = option(
        None,
        "Directory for this run's event log and agent files. Default: <log-dir>/<run-id> when "
        "--log-dir is given, else ./elasticft-runs/<run-id> (with the workers' logs in "
        "<run-dir>/logs).",
    )
    event_dir: Path | None = option(
        None,
        "Directory of the JSONL event log (overrides <run-dir>); `elasticft report` reads it.",
    )
    node_id: str | None = option(
        None,
        "This node's name in events, the blacklist and the rendezvous; unique among the job's "
        "agents. Default: the host name, <host>-2, -3, ... for more agents of the job on one "
        "host.",
    )
    capture_stderr: bool = option(
        True,
        "Also copy each worker's stderr to a file so failures can be classified from the "
        "traceback of scripts that do not use torch's @record.",
    )
    share_rdzv_store: bool = option(
        False,
        "Let workers use the agent-hosted shared TCPStore (torch's default). Off by default: the "
        "shared store keeps a previous attempt's keys and breaks restarts (pytorch#135712).",
    )
    warm_start: bool = option(
        True,
        "Fork workers from a warm interpreter per local rank that has imported torch once, "
        "so a restart re-imports nothing. Python workers only; off: every start is a fresh "
        "interpreter, as with torchrun.",
    )


@dataclasses.dataclass(frozen=True)
class PlanConfig:
    """The 3D-parallel layout chosen after every rendezvous round (elasticft.plan)."""

    plan_model: str | None = option(
        None,
        "Model description for the layout planner: a JSON/YAML file (layers, hidden, heads, "
        "seq_len, global_batch, micro_batch, ...) or a preset name (`elasticft plan --help`). "
        "Unset: no layout is planned unless a dimension is pinned.",
    )
    plan_hardware: str = option(
        "a100-80g",
        "GPU speeds and memory for the planner: a preset (a100-80g, a100-40g, h100-80g, cpu) "
        "or a JSON file of its fields.",
    )
    plan_gpu_memory_gib: float | None = option(
        None, "Memory per GPU in GiB for the planner (overrides the hardware's).", minimum=0.001
    )
    plan_probe: bool = option(
        False,
        "Measure this machine's matrix-multiply speed at start-up (a ~1 s probe) and plan with "
        "it instead of the hardware's nominal compute speed.",
    )
    layout_tp: int | None = option(
        None, "Pin tensor parallelism to this size (must divide the GPUs per node).", minimum=1
    )
    layout_pp: int | None = option(
        None, "Pin pipeline parallelism to this size (must divide the layers).", minimum=1
    )
    layout_dp: int | None = option(
        None, "Pin data parallelism to this size (must divide global/micro batch).", minimum=1
    )


@dataclasses.dataclass(frozen=True)
class SlurmConfig:
    """What the launcher does under Slurm: time-limit signal, requeue, cancel (elasticft.slurm)."""

    slurm_mode: Literal["auto", "on", "off"] = option(
        "auto",
        "Slurm integration: auto (when SLURM_JOB_ID is set), on (fail if it is not), off.",
    )
    slurm_signal: str = option(
        "SIGUSR1",
        "The signal Slurm sends before the time limit (sbatch --signal=B:USR1@120). The agent "
        "checkpoints, requeues and exits on it; plain scripts get it forwarded.",
    )
    slurm_signal_lead_time: timedelta = option(
        timedelta(seconds=120),
        "Seconds between that signal and the time limit (the @120 of --signal). The save may "
        "take 80% of it; the rest is left for the requeue and a clean exit.",
        minimum=1,
    )
    slurm_requeue: Literal["scontrol", "sbatch", "off"] = option(
        "scontrol",
        "How the job continues after a time-limit checkpoint: `scontrol requeue $SLURM_JOB_ID` "
        "(same job id; needs requeue allowed), a new `sbatch` of the job's script, or off.",
    )
    slurm_resubmit_script: Path | None = option(
        None,
        "Batch script that --slurm-requeue sbatch submits. Default: the job's own script "
        "(Command of `scontrol show job`).",
    )
    slurm_save_on_cancel: bool = option(
        False,
        "On scancel (SIGTERM), ask the workers to checkpoint before stopping. Off: log it and "
        "exit at once. A cancelled job is never resubmitted.",
    )


@dataclasses.dataclass(frozen=True)
class DiagConfig:
    """Diagnostics: hang, slow-rank, loss, log and node-health detection (elasticft.diag)."""

    diag_enabled: bool = option(
        True, "Watch workers for hangs, slow ranks, bad losses, error bursts and node health.")
    diag_ring_dir: Path | None = option(
        None, "Directory whose file system holds the per-rank progress rings (shared memory; "
        "files with no name, nothing to remove). Default: /dev/shm.")
    diag_ring_capacity: int = option(
        4096, "Records kept per rank and producer in the progress ring.", minimum=64)
    diag_auto_install: bool = option(
        True,
        "Record gloo collectives, DDP buckets and optimizer steps in scripts that do not call "
        "elasticft.init(), through the sitecustomize bootstrap put first on every worker's "
        "PYTHONPATH (it also writes the step records of `elasticft report`, and runs the "
        "site's own sitecustomize).")
    diag_nccl_shim: Literal["auto", "on", "off"] = option(
        "auto",
        "Time NCCL calls with the LD_PRELOAD shim. auto: when this node has an NVIDIA GPU.")
    diag_check_interval_s: float = option(
        0.2, "Seconds between two evaluations of the detectors (at most).", minimum=0.05)
    hang_collective_floor_s: float = option(
        3.0, "Once collective history exists, ranks all waiting in collectives with nothing "
        "progressing are never called stuck before this many seconds.", minimum=0.1)
    hang_busy_ceiling_s: float = option(
        1800.0, "Peers may wait this long for a rank that is alive and busy outside collectives "
        "(evaluation, a slow save) before it is called hung (torch's process-group timeout).",
        minimum=1.0)
    hang_multiple: float = option(
        5.0, "Stuck-collective timeout = max(floor, multiple x the percentile of recent "
        "durations).", minimum=1.0)
    hang_percentile: float = option(
        99.0, "Percentile of recent collective/step durations the hang timeout scales.",
        minimum=1.0)
    hang_history: int = option(
        500, "Recent durations (per kind) the hang timeout is learned from.", minimum=10)
    hang_min_samples: int = option(
        10, "Durations needed before the adaptive timeout replaces the initial one.", minimum=1)
    hang_initial_timeout_s: float = option(
        600.0, "Stuck-collective timeout before enough history exists (first compile, warm-up, "
        "first steps).", minimum=1.0)
    hang_heartbeat_stale_s: float = option(
        2.0, "A worker stopped, exited or in D state without CPU whose recorder thread has not "
        "beaten for this long, while peers wait on it, is called frozen.",
        minimum=0.2)
    hang_stacks: bool = option(
        True, "Sample local ranks' stacks with py-spy: before calling a collective stuck (a "
        "moving stack is work), and on a hang to report outliers.")
    slow_ratio: float = option(
        2.0, "A rank is slow when its busy time per step exceeds this multiple of its peers' "
        "median.", minimum=1.0)
    slow_min_excess_s: float = option(
        0.02, "A slow rank must also exceed its peers' median by this many seconds.",
        minimum=0.0)
    slow_window: int = option(
        10, "Recent steps whose median busy time is compared.", minimum=3)
    slow_confirm_s: float = option(
        5.0, "A rank must stay slow this long before it is reported.", minimum=0.0)
    slow_action: Literal["report", "restart"] = option(
        "report", "What a slow rank causes: a detection event only, or a restart.")
    diag_loss_spike_factor: float = option(
        5.0, "A loss this many times the recent median is a spike.", minimum=1.0)
    diag_loss_action: Literal["report", "restart"] = option(
        "restart", "What a NaN/inf loss or a loss spike causes.")
    diag_log_pattern: str = option(
        r"Traceback|Error|ERROR|NCCL WARN|CUDA error|Segmentation fault",
        "Regular expression of an error line in the workers' captured logs.")
    diag_log_window_s: float = option(
        30.0, "Sliding window of the log error-rate detector.", minimum=1.0)
    diag_log_threshold: int = option(
        50, "Error lines within the window that raise a detection event.", minimum=1)
    health_interval_s: float = option(
        5.0, "Seconds between node health checks (GPU, memory, disk, peers).", minimum=0.5)
    health_dirs: tuple[str, ...] = option(
        (), "Directories whose free space is checked besides the run directory (checkpoints).")
    health_min_free_gb: float = option(
        1.0, "Less free space than this in a checked directory makes the node unhealthy.",
        minimum=0.0)
    health_max_memory_percent: float = option(
        98.0, "Host memory use above this percentage makes the node unhealthy.", minimum=1.0)
    health_max_gpu_temp_c: float = option(
        92.0, "GPU temperature above this is reported.", minimum=1.0)
    diag_preflight: bool = option(
        True, "Check directories, disk, memory and GPUs before the first workers start.")
    diag_preflight_allreduce: bool = option(
        False, "Also run a short all-reduce sanity and bandwidth test among this node's "
        "worker slots before the first start (a few seconds).")
    diag_metrics_port: int = option(
        0, "Serve Prometheus metrics (step time, collective latency, detections, restarts) on "
        "this port of --diag-metrics-host. 0: off.", minimum=0)
    diag_metrics_host: str = option(
        "127.0.0.1", "Address the Prometheus metrics endpoint binds (this node's address to let "
        "a Prometheus server on another machine scrape it).")
    diag_metrics_token: str | None = option(
        None, "When set, the metrics endpoint answers only requests with the header "
        "'Authorization: Bearer <token>'.")


@dataclasses.dataclass(frozen=True)
class CheckpointConfig:
    """The agent's checkpoint service: shared-memory tier, local/remote disk, peer backup."""

    ckpt_enabled: bool = option(
        True, "Run the checkpoint service: workers using elasticft.ckpt.Checkpointer snapshot "
        "into agent-owned shared memory that survives their crash.")
    ckpt_dir: Path | None = option(
        None, "Local checkpoint directory (tier 2). Default: <run-dir>/ckpt.")
    ckpt_remote_dir: Path | None = option(
        None, "Shared-storage checkpoint directory (tier 3), written after the local one; "
        "every node of the job must see the same path.")
    ckpt_persist_every: int = option(
        10, "Persist the memory snapshot of every N-th step to disk in the background "
        "(0: only on failure, on request and at the end).", minimum=0)
    ckpt_keep: int = option(
        3, "Committed checkpoints kept per directory (older ones are deleted).", minimum=1)
    ckpt_memory_slots: int = option(
        3, "Shared-memory snapshots kept per worker: the newest complete one, one the agent "
        "may be copying out, one being written (with 2, a save that finds the agent reading "
        "the other slot is skipped, with a warning).", minimum=2)
    ckpt_memory_cap_mb: int = option(
        0, "Most shared memory per worker for snapshots, in MiB (0: no cap); the oldest "
        "snapshot is evicted first.", minimum=0)
    ckpt_gpu_staging_mb: int = option(
        0, "Device memory per worker, in MiB, that a snapshot of CUDA state may be staged in: "
        "training then waits only for a device-to-device copy, and the copy to host memory "
        "overlaps the next steps (0: no staging; training's next optimizer step waits on the "
        "device for the copy to host).", minimum=0)
    ckpt_peer_backup: bool = option(
        True, "Copy each node's checkpoint shards to a backup node over TCP (multi-node jobs).")
    ckpt_peer_addr: str | None = option(
        None, "Address the peer-backup server binds. Default: --local-addr, else this host's "
        "address.")
    ckpt_peer_secret: str | None = option(
        None, "Shared secret peer-backup connections must prove. Default: generated per job "
        "and handed out through the rendezvous store.")
    ckpt_layout: str | None = option(
        None, "Parallel layout 'tp,pp,dp' for placing backups outside a node's own parallel "
        "groups. Default: the next node in a ring.")
    ckpt_flush_on_failure: bool = option(
        True, "When a worker fails, persist the newest complete snapshot before restarting.")


@dataclasses.dataclass(frozen=True)
class RecoveryConfig:
    """Hierarchical recovery: just-in-time checkpoints, eviction and blacklisting of nodes."""

    recovery_enabled: bool = option(
        True, "Orchestrate recovery: just-in-time checkpoints from healthy replicas, eviction "
        "of suspect nodes, blacklisting of nodes that vanished.")
    recovery_jit_timeout_s: float = option(
        10.0, "Longest wait for healthy workers to confirm a just-in-time checkpoint.",
        minimum=0)
    recovery_repeat_offender: int = option(
        3, "Failures caused by one node's ranks after which it counts as suspect hardware and "
        "is evicted when the job can go on without it (0: never).", minimum=0)
    recovery_blacklist: bool = option(
        True, "Blacklist evicted nodes and nodes that vanished from a round (etcd-v3 "
        "rendezvous), with the evidence as the reason.")
    recovery_departed_grace_s: float = option(
        6.0, "How long the leader waits for a node missing from a new round to show a live "
        "membership record before it counts as vanished.", minimum=0)


@dataclasses.dataclass(frozen=True)
class ElasticftConfig:
    """All of elasticft's options; one attribute per subsystem section."""

    agent: AgentConfig = dataclasses.field(default_factory=AgentConfig)
    plan: PlanConfig = dataclasses.field(default_factory=PlanConfig)
    slurm: SlurmConfig = dataclasses.field(default_factory=SlurmConfig)
    diag: DiagConfig = dataclasses.field(default_factory=DiagConfig)
    ckpt: CheckpointConfig = dataclasses.field(default_factory=CheckpointConfig)
    recovery: RecoveryConfig = dataclasses.field(default_factory=RecoveryConfig)
