"""elasticft's own options, declared in one place.

Every option lives in a frozen dataclass of its subsystem (a *section*). Each field is declared
once, with :func:`option`, and that single declaration gives it

* a command-line flag ``--field-name`` on ``elasticft-run``,
* an environment variable ``ELASTICFT_FIELD_NAME``,
* a YAML key in the file given with ``--config``: ``<prefix>: {rest: ...}`` when the name starts
  with one of :data:`YAML_SECTIONS` (``ckpt_dir`` is ``ckpt: {dir: ...}``), else a top-level
  ``field_name: ...``.

Knobs few users should turn are declared with :func:`tuning` instead: fields that the Python API
(custom agents, tests) can set, which no flag, variable or YAML key reads. Options that were
removed or merged are listed in :mod:`elasticft.removed_options`, so that an old variable or
YAML key is an error naming what replaced it.

:mod:`elasticft.options` reads them (precedence CLI flag > ``ELASTICFT_*`` env > YAML file >
default). torchrun's own flags (and their ``PET_*`` variables) stay with torch's parser.

A value that cannot be used raises :class:`~elasticft.optionvalues.ConfigError`, whose message
names the value, where it came from and how to fix it, in one line; the values with a structure
of their own (a pinned layout, Slurm's signal, the metrics endpoint) are in
:mod:`elasticft.optionvalues`.
"""

from __future__ import annotations

import dataclasses
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal

from elasticft.optionvalues import (
    ConfigError,
    MetricsEndpoint,
    PinnedLayout,
    SlurmSignal,
    bad_value,
)

ENV_PREFIX = "ELASTICFT_"
RUNS_DIR = Path("elasticft-runs")
"""Where runs go without --run-dir or --log-dir: ``RUNS_DIR/<run id>``, relative to the cwd."""
YAML_SECTIONS = ("plan", "slurm", "preempt", "diag", "hang", "slow", "ckpt", "recovery")
"""Name prefixes that are YAML sections: ``--hang-initial-timeout-s`` is
``hang: {initial_timeout_s: ...}``; an option without one is a top-level key."""


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


def run_dir_default(run_dir: Path | None, log_dir: str | Path | None, run_id: str) -> Path:
    """The run directory: ``--run-dir`` when given, else ``<log-dir>/<run id>`` when the user gave
    a --log-dir (not one of torch's own ``/tmp/torchelastic_*``), else ``RUNS_DIR/<run id>``."""
    if run_dir is not None:
        return Path(run_dir)
    if log_dir and not str(log_dir).startswith("/tmp/torchelastic_"):
        return Path(log_dir) / run_id
    return RUNS_DIR / run_id


def checkpoint_dir_default(ckpt_dir: Path | None, run_dir: Path) -> Path:
    """The local checkpoint directory: ``--ckpt-dir`` when given, else ``<run-dir>/ckpt``."""
    return Path(ckpt_dir) if ckpt_dir is not None else Path(run_dir) / "ckpt"


def option(default: Any, help: str, *, minimum: float | None = None,
           parse: Callable[[Any, str], Any] | None = None, kind: str | None = None) -> Any:
    """Declares a field of a config section with its help text (shown by ``--help``).

    ``parse(value, source)`` converts a raw value of a structured option (``--layout 2,*,*``)
    and raises a one-line :class:`ConfigError`; ``kind`` describes its syntax in the help.
    """
    return dataclasses.field(default=default, metadata={
        "help": help, "minimum": minimum, "parse": parse, "kind": kind})


def tuning(default: Any, help: str) -> Any:
    """Declares a tuning constant: settable through the Python API only (no flag, env or YAML).

    For knobs whose default suits every user; tests and custom agents may still change them.
    """
    return dataclasses.field(default=default, metadata={"help": help, "tuning": True})


def is_tuning(field: dataclasses.Field[Any]) -> bool:
    return bool(field.metadata.get("tuning"))


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
    restart_backoff_s: float = option(
        1.0,
        "Wait before restarting when a communication fault repeats identically before the "
        "first step (its cause may need time to clear); doubled at each further repeat, up to "
        "30 s (restart_backoff_max_s), less up to 25 % jitter. A step completed resets it. 0: "
        "no wait.",
        minimum=0.0,
    )
    restart_backoff_max_s: float = tuning(
        30.0, "The longest wait before a restart after a repeated communication fault.")
    run_dir: Path | None = option(
        None,
        "Directory for this run's event log and agent files. Default: <log-dir>/<run-id> when "
        "--log-dir is given, else ./elasticft-runs/<run-id> (with the workers' logs in "
        "<run-dir>/logs). The run id is --rdzv-id, slurm-<job id> under Slurm, else (one node) "
        "one derived from the script, the worker counts (--nnodes, --nproc-per-node) and the "
        "directory, not the script's arguments: a relaunch, with other arguments too, finds "
        "its run directory and resumes from its checkpoints.",
    )
    fresh: bool = option(
        False,
        "Start this launch from step 0: the checkpoints earlier launches of the job left in its "
        "local checkpoint directory (the script's own, else --ckpt-dir, else <run-dir>/ckpt) "
        "are removed before the workers restore. Without it a relaunch resumes from the newest "
        "committed checkpoint.",
    )
    event_dir: Path | None = tuning(
        None,
        "Directory of the JSONL event log (overrides <run-dir>); `elasticft report` reads it.")
    node_id: str | None = option(
        None,
        "This node's name in events, the blacklist and the rendezvous; unique among the job's "
        "agents. Default: the host name, <host>-2, -3, ... for more agents of the job on one "
        "host.",
    )
    capture_stderr: bool = tuning(
        True,
        "Also copy each worker's stderr to a file so failures can be classified from the "
        "traceback of scripts that do not use torch's @record.")
    share_rdzv_store: bool = tuning(
        False,
        "Let workers use the agent-hosted shared TCPStore (torch's default). Off by default: the "
        "shared store keeps a previous attempt's keys and breaks restarts (pytorch#135712).")
    warm_start: bool = option(
        True,
        "Fork every local rank's workers from one warm interpreter per node that has imported "
        "torch once, so a restart re-imports nothing. Python workers only; off: every start is "
        "a fresh interpreter, as with torchrun.",
    )
    warm_frameworks: bool = tuning(
        True,
        "With warm start, the warm interpreter also imports the training frameworks the script "
        "imports at its top (Lightning, torchmetrics, Transformers, Accelerate), so a worker or a "
        "replacement starts with them imported. Off: it imports torch only.")


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
    plan_gpu_memory_gib: float | None = tuning(
        None, "Memory per GPU in GiB for the planner (overrides the hardware's).")
    plan_probe: bool = tuning(
        False,
        "Measure this machine's matrix-multiply speed at start-up (about 0.5 s of matrix "
        "products) and plan with it instead of the hardware's nominal compute speed.")
    layout: PinnedLayout | None = option(
        None,
        "Pin the parallel layout TP,PP,DP, with * for a dimension left to the planner (2,*,*: "
        "tensor parallelism 2, the rest planned). TP must divide the GPUs per node, PP the "
        "layers, DP global/micro batch. A fully given layout also places each node's peer "
        "backup outside its own parallel groups; otherwise backups go to the next node in a "
        "ring.",
        parse=PinnedLayout.parse, kind="TP,PP,DP")


@dataclasses.dataclass(frozen=True)
class SlurmConfig:
    """What the launcher does under Slurm: time-limit signal, requeue, cancel (elasticft.slurm)."""

    slurm_mode: Literal["auto", "on", "off"] = option(
        "auto",
        "Slurm integration: auto (when SLURM_JOB_ID is set), on (fail if it is not), off.",
    )
    slurm_signal: SlurmSignal = option(
        SlurmSignal(),
        "The job's sbatch --signal, in sbatch's syntax [B:]SIG[@SECONDS]: the signal Slurm sends "
        "and how many seconds before the time limit. The agent checkpoints, requeues and exits "
        "on it (the save may take 80% of the lead time; the rest is left for the requeue and a "
        "clean exit); plain scripts get it forwarded.",
        parse=SlurmSignal.parse, kind="[B:]SIG[@SECONDS]")
    slurm_requeue: Literal["scontrol", "sbatch", "off"] = option(
        "scontrol",
        "How the job continues after a time-limit checkpoint: `scontrol requeue $SLURM_JOB_ID` "
        "(same job id; needs requeue allowed), a new `sbatch` of the job's script (submitted "
        "by the first node), or off.",
    )
    slurm_resubmit_script: Path | None = tuning(
        None,
        "Batch script that --slurm-requeue sbatch submits. Default: the job's own script "
        "(Command of `scontrol show job`).")
    slurm_save_on_cancel: bool = option(
        False,
        "On scancel (SIGTERM), ask the workers to checkpoint before stopping. Off: log it and "
        "exit at once. A cancelled job is never resubmitted.",
    )


def parse_notices(value: Any, source: str = "--preempt-notices") -> str:
    """``auto``, ``off``, or the http(s) URL of one metadata server that answers for every
    provider (a site's proxy, a test's server). YAML reads a bare off as false."""
    text = ("off" if value is False else "auto" if value is True else str(value)).strip()
    if text in ("auto", "off") or text.startswith(("http://", "https://")):
        return text.rstrip("/")
    raise bad_value(source, value, "give auto, off or a metadata server's URL (http://HOST[:PORT])")


@dataclasses.dataclass(frozen=True)
class PreemptConfig:
    """Preemption notices: cloud metadata endpoints, Kubernetes' SIGTERM (elasticft.preemption)."""

    preempt_notices: str = option(
        "auto",
        "Watch for preemption notices. auto: the cloud metadata endpoints (AWS, Google Cloud, "
        "Azure) that answer at start are polled, and under Kubernetes SIGTERM is one; a URL: "
        "that server answers for every provider; off: SIGTERM stops the run as under torchrun. "
        "On a notice the newest snapshot is persisted, the workers stop and the launcher exits "
        "75 (preempted, resume me).",
        parse=parse_notices, kind="auto|off|URL")
    preempt_grace_s: float = option(
        30.0, "Under Kubernetes: seconds from SIGTERM to SIGKILL, the pod's "
        "terminationGracePeriodSeconds (Kubernetes' default is 30).", minimum=1)
    preempt_poll_s: float = tuning(
        2.0, "Seconds between two polls of a cloud metadata endpoint that answered.")
    preempt_probe_timeout_s: float = tuning(
        1.0, "Longest wait for a cloud metadata endpoint's first answer (in the background).")
    preempt_aws_url: str = tuning(
        "http://169.254.169.254", "AWS's instance metadata (spot/instance-action, rebalance).")
    preempt_gcp_url: str = tuning("http://metadata.google.internal",
                                  "Google Cloud's metadata server (instance/preempted).")
    preempt_azure_url: str = tuning("http://169.254.169.254", "Azure's Scheduled Events.")

    def urls(self) -> tuple[str, str, str]:
        """The AWS, Google Cloud and Azure base URLs (one server's when --preempt-notices is)."""
        if self.preempt_notices.startswith(("http://", "https://")):
            return (self.preempt_notices,) * 3
        return self.preempt_aws_url, self.preempt_gcp_url, self.preempt_azure_url


@dataclasses.dataclass(frozen=True)
class DiagConfig:
    """Diagnostics: hang, slow-rank, loss, log and node-health detection (elasticft.diag)."""

    diag_enabled: bool = option(
        True, "Watch workers for hangs, slow ranks, bad losses, error bursts and node health.")
    diag_ring_dir: Path | None = tuning(
        None, "Directory whose file system holds the per-rank progress rings (shared memory; "
        "files with no name, nothing to remove). Default: /dev/shm.")
    diag_ring_capacity: int = tuning(
        4096, "Records kept per rank and producer in the progress ring.")
    diag_auto_install: bool = option(
        True,
        "Record gloo collectives, DDP buckets and optimizer steps in scripts that do not call "
        "elasticft.init(), through the sitecustomize bootstrap put first on every worker's "
        "PYTHONPATH (it also writes the step records of `elasticft report`, and runs the "
        "site's own sitecustomize).")
    diag_nccl_shim: Literal["auto", "on", "off"] = option(
        "auto",
        "Time NCCL calls with the LD_PRELOAD shim. auto: when this node has an NVIDIA GPU.")
    diag_check_interval_s: float = tuning(
        0.2, "Seconds between two evaluations of the detectors (at most).")
    hang_collective_floor_s: float = tuning(
        3.0, "Once collective history exists, ranks all waiting in collectives with nothing "
        "progressing are never called stuck before this many seconds.")
    hang_busy_ceiling_s: float = option(
        1800.0, "Peers may wait this long for a rank that is alive and busy outside collectives "
        "(evaluation, a slow save) before it is called hung (torch's process-group timeout).",
        minimum=1.0)
    hang_multiple: float = tuning(
        5.0, "Stuck-collective timeout = max(floor, multiple x the percentile of recent "
        "durations).")
    hang_percentile: float = tuning(
        99.0, "Percentile of recent collective/step durations the hang timeout scales.")
    hang_history: int = tuning(
        500, "Recent durations (per kind) the hang timeout is learned from.")
    hang_min_samples: int = tuning(
        10, "Durations needed before the adaptive timeout replaces the initial one.")
    hang_initial_timeout_s: float = option(
        600.0, "Stuck-collective timeout before enough history exists (first compile, warm-up, "
        "first steps).", minimum=1.0)
    hang_heartbeat_stale_s: float = tuning(
        2.0, "A worker stopped, exited or in D state without CPU whose recorder thread has not "
        "beaten for this long, while peers wait on it, is called frozen.")
    hang_stacks: bool = tuning(
        True, "Sample local ranks' stacks with py-spy: before calling a collective stuck (a "
        "moving stack is work), and on a hang to report outliers.")
    slow_ratio: float = tuning(
        2.0, "A rank is slow when its busy time per step exceeds this multiple of its peers' "
        "median.")
    slow_min_excess_s: float = tuning(
        0.02, "A slow rank must also exceed its peers' median by this many seconds.")
    slow_window: int = tuning(
        10, "Recent steps whose median busy time is compared.")
    slow_confirm_s: float = tuning(
        5.0, "A rank must stay slow this long before it is reported.")
    slow_action: Literal["report", "restart"] = option(
        "report", "What a slow rank causes: a detection event only, or a restart.")
    diag_loss_spike_factor: float = tuning(
        5.0, "A loss this many times the recent median is a spike.")
    diag_loss_action: Literal["report", "restart"] = option(
        "restart", "What a NaN/inf loss or a loss spike causes.")
    diag_log_pattern: str = option(
        r"Traceback|Error|ERROR|NCCL WARN|CUDA error|Segmentation fault",
        "Regular expression of an error line in the workers' captured logs.")
    diag_log_window_s: float = tuning(
        30.0, "Sliding window of the log error-rate detector.")
    diag_log_threshold: int = tuning(
        50, "Error lines within the window that raise a detection event.")
    health_interval_s: float = tuning(
        5.0, "Seconds between node health checks (GPU, memory, disk, peers).")
    health_dirs: tuple[str, ...] = tuning(
        (), "Directories whose free space is checked besides the run directory (checkpoints).")
    health_min_free_gb: float = tuning(
        1.0, "Less free space than this in a checked directory makes the node unhealthy.")
    health_max_memory_percent: float = tuning(
        98.0, "Host memory use above this percentage makes the node unhealthy.")
    health_max_gpu_temp_c: float = tuning(
        92.0, "GPU temperature above this is reported.")
    diag_preflight: Literal["off", "on", "allreduce"] = option(
        "on", "Checks before the first workers start. on: directories, disk, memory and GPUs; "
        "allreduce: also a short all-reduce sanity and bandwidth test among this node's worker "
        "slots (a few seconds); off: none.")
    diag_metrics: MetricsEndpoint | None = option(
        None, "Serve Prometheus metrics (step time, collective latency, detections, restarts) at "
        "[HOST:]PORT; HOST defaults to 127.0.0.1 (give this node's address, or 0.0.0.0, to let "
        "a Prometheus server on another machine scrape it). off: no endpoint.",
        parse=MetricsEndpoint.parse, kind="[HOST:]PORT or off")
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
        None, "Local checkpoint directory (the local tier). Default: <run-dir>/ckpt. A directory "
        "the script gives Checkpointer.from_env(ckpt_dir=...) wins over both.")
    ckpt_remote_dir: Path | None = option(
        None, "Shared-storage checkpoint directory (the remote tier), written after the local one; "
        "every node of the job must see the same path.")
    ckpt_persist_every: int = option(
        10, "Persist the memory snapshot of every N-th step to disk in the background "
        "(0: only on failure, on request and at the end).", minimum=0)
    ckpt_keep: int = option(
        3, "Committed checkpoints kept per directory (older ones are deleted).", minimum=1)
    ckpt_memory_slots: int = tuning(
        3, "Shared-memory snapshots kept per worker: the newest complete one, one the agent "
        "may be copying out, one being written (with 2, a save that finds the agent reading "
        "the other slot is skipped, with a warning).")
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
    ckpt_peer_addr: str | None = tuning(
        None, "Address the peer-backup server binds. Default: --local-addr, else this host's "
        "address.")
    ckpt_peer_secret: str | None = tuning(
        None, "Shared secret peer-backup connections must prove. Default: generated per job "
        "and handed out through the rendezvous store.")
    ckpt_fingerprint_every: int = option(
        0, "Every N-th step, fingerprint the replicated state (parameters and optimizer state) "
        "of each worker's memory snapshot in the agent and compare the data-parallel replicas "
        "of the job (on the round's leader): a rank that differs from the majority of its "
        "replica set is an sdc_suspect event (silent data corruption); with two replicas "
        "the finding is sdc_undecidable until a second reading (or, under --ckpt-sdc-action "
        "evict, a recomputation of the step) decides it. Costs the agent "
        "one read of the snapshot, the training processes nothing (0: off). Snapshots taken "
        "with dedup_replicas have no fingerprint.", minimum=0)
    ckpt_sdc_action: Literal["report", "evict"] = option(
        "report", "What a finding of the fingerprints causes: report (the sdc events only), or "
        "evict: the node of a rank named is evicted and blacklisted with reason sdc, the job "
        "restores the newest step at which every fingerprint agreed (kept in memory until a "
        "newer one agrees) and redoes the steps after it; two replicas that differ redo those "
        "steps too, and the side whose result changes is named. Needs "
        "--ckpt-fingerprint-every and at least 3 memory slots.")
    ckpt_flush_on_failure: bool = tuning(
        True, "When a worker fails, persist the newest complete snapshot before restarting.")


@dataclasses.dataclass(frozen=True)
class RecoveryConfig:
    """Hierarchical recovery: just-in-time checkpoints, eviction and blacklisting of nodes."""

    recovery_enabled: bool = option(
        True, "Orchestrate recovery: just-in-time checkpoints from healthy replicas, eviction "
        "of suspect nodes, quarantine of nodes that vanished.")
    recovery_jit_timeout_s: float = tuning(
        10.0, "Longest wait for healthy workers to confirm a just-in-time checkpoint.")
    recovery_repeat_offender: int = option(
        3, "Failures caused by one node's ranks after which it counts as suspect hardware and "
        "is evicted when the job can go on without it (0: never).", minimum=0)
    recovery_blacklist: bool = option(
        True, "Blacklist the machine of a node evicted on evidence about it, and quarantine "
        "in the job a node that vanished from a round (etcd-v3 rendezvous), with the evidence "
        "as the reason.")
    recovery_quarantine_s: float = tuning(
        300.0, "How long a node that disappeared from a round is kept out of this job (its id, "
        "this job only; a per-process id and the agent itself, alive after all, are not).")
    recovery_inprocess_timeout_s: float = tuning(
        60.0, "Longest an in-process recovery may take, from the failure to every worker's "
        "first step in the new group, before the agent falls back to a full restart.")
    recovery_inprocess_teardown_limit_s: float = option(
        30.0, "Hard limit of a survivor's teardown in an in-process recovery (the abort of its "
        "process groups, the device's synchronize and release) and of its device's health "
        "check, and of its way out of the training function from the agent's interrupt "
        "notice: a survivor that overruns it or whose device is unfit is killed and replaced "
        "while the others go on in process. Keep torch's NCCL watchdog above it.", minimum=1)
    recovery_inprocess_spare: bool = option(
        False, "Keep one pre-started spare process per node for in-process recovery: it runs "
        "the script's set-up before any failure and takes a failed rank's place, so recovery "
        "does not wait for a new process's start-up (costs one rank's memory more per node).")
    recovery_inprocess_regroup: Literal["auto", "new-group"] = option(
        "auto", "How an in-process recovery rebuilds the default process group: auto rebuilds "
        "it in place with torch's reconfigure where the installed torch has it (torch >= 2.14: "
        "the script's default group is made for it, nothing added to the script), else makes a "
        "new group; new-group always makes a new group, as on an older torch.")
    recovery_departed_grace_s: float = tuning(
        6.0, "How long the leader waits for a node missing from a new round to show a live "
        "membership record before it counts as vanished.")


@dataclasses.dataclass(frozen=True)
class ElasticftConfig:
    """All of elasticft's options; one attribute per subsystem section."""

    agent: AgentConfig = dataclasses.field(default_factory=AgentConfig)
    plan: PlanConfig = dataclasses.field(default_factory=PlanConfig)
    slurm: SlurmConfig = dataclasses.field(default_factory=SlurmConfig)
    preempt: PreemptConfig = dataclasses.field(default_factory=PreemptConfig)
    diag: DiagConfig = dataclasses.field(default_factory=DiagConfig)
    ckpt: CheckpointConfig = dataclasses.field(default_factory=CheckpointConfig)
    recovery: RecoveryConfig = dataclasses.field(default_factory=RecoveryConfig)
