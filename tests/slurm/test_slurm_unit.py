"""The Slurm pieces that need no cluster: host lists, torchrun defaults, the handler's time-limit
sequence against real worker processes (with a recorded stand-in for scontrol)."""

from __future__ import annotations

import dataclasses
import signal
import subprocess
import sys
from datetime import timedelta
from pathlib import Path

import pytest

from elasticft.addon.api import GroupInfo, StopRun, WorkerInfo
from elasticft.config import ConfigError, SlurmConfig, SlurmSignal
from elasticft.events import read_events
from elasticft.optionvalues import parse_signal_name
from elasticft.run import build_parser
from elasticft.slurm import (
    SlurmEnv,
    SlurmHandler,
    detect,
    expand_nodelist,
    job_fields,
    node_defaults,
    requeue_command,
    run_id_default,
)


@pytest.mark.parametrize(
    ("nodelist", "hosts"),
    [
        ("node1", ("node1",)),
        ("gpu[01-03,7],login", ("gpu01", "gpu02", "gpu03", "gpu7", "login")),
        ("a[1-2]-b[3-4]", ("a1-b3", "a1-b4", "a2-b3", "a2-b4")),
        ("n[008-010]", ("n008", "n009", "n010")),
        ("", ()),
    ],
)
def test_expand_nodelist(nodelist, hosts):
    assert expand_nodelist(nodelist) == hosts


def slurm_env(**extra):
    env = {"SLURM_JOB_ID": "42", "SLURM_JOB_NODELIST": "gpu[1-4]", "SLURM_PROCID": "2",
           "SLURM_NODEID": "2", "SLURM_RESTART_COUNT": "1"}
    env.update(extra)
    return env


def test_env_detection_and_node_rank():
    s = SlurmEnv.from_env(slurm_env())
    assert s is not None and s.nodes == ("gpu1", "gpu2", "gpu3", "gpu4")
    assert (s.node_rank, s.master_addr, s.restart_count) == (2, "gpu1", 1)
    # A batch script without srun: SLURM_PROCID is 0 and only SLURM_NODEID counts.
    assert SlurmEnv.from_env(slurm_env(SLURM_PROCID="7", SLURM_NODEID="3")).node_rank == 3
    assert detect(SlurmConfig(), {}) is None
    assert detect(SlurmConfig(slurm_mode="off"), slurm_env()) is None
    with pytest.raises(ConfigError, match="SLURM_JOB_ID"):
        detect(SlurmConfig(slurm_mode="on"), {})


def parse(argv):
    return build_parser().parse_args(argv)


def test_node_defaults_fill_only_what_the_user_left_out():
    s = SlurmEnv.from_env(slurm_env())
    argv = ["--nproc-per-node", "2", "train.py", "--node-rank", "9"]  # script's own flag
    args = parse(argv)
    changed = node_defaults(args, argv, {}, s)
    assert changed == {"nnodes": "4", "node_rank": 2, "master_addr": "gpu1"}
    assert (args.nnodes, args.node_rank, args.master_addr) == ("4", 2, "gpu1")

    argv = ["--nnodes", "2", "--node-rank", "1", "--master-addr", "h0", "train.py"]
    args = parse(argv)
    assert node_defaults(args, argv, {}, s) == {}
    assert (args.nnodes, args.node_rank, args.master_addr) == ("2", 1, "h0")

    argv = ["--rdzv-backend", "c10d", "train.py"]
    args = parse(argv)
    node_defaults(args, argv, {"PET_NODE_RANK": "0"}, s)
    assert args.rdzv_endpoint == "gpu1:29400"
    assert "node_rank" not in node_defaults(parse(argv), argv, {"PET_NODE_RANK": "0"}, s)

    args = parse(["train.py"])
    assert run_id_default(args, ["train.py"], {}, s) == "slurm-42"
    args = parse(["--rdzv-id", "mine", "train.py"])
    assert run_id_default(args, ["--rdzv-id", "mine", "train.py"], {}, s) is None
    assert args.rdzv_id == "mine"


def test_signal_names_and_scontrol_parsing():
    assert parse_signal_name("USR1") is signal.SIGUSR1
    assert parse_signal_name("sigusr2") is signal.SIGUSR2
    assert parse_signal_name("10") is signal.SIGUSR1
    with pytest.raises(ConfigError, match="--slurm-signal='USR9'"):
        parse_signal_name("USR9")
    fields = job_fields("JobId=5 JobName=a b Command=/x/job.sh arg1 WorkDir=/w dir StdIn=/dev/null")
    assert fields["Command"] == "/x/job.sh arg1" and fields["WorkDir"] == "/w dir"


class Recorder:
    """Stands in for scontrol/sbatch: records the command, answers like Slurm would."""

    def __init__(self, show: str = "", returncode: int = 0, show_returncode: int | None = None
                 ) -> None:
        self.calls: list[list[str]] = []
        self.show, self.returncode = show, returncode
        self.show_returncode = returncode if show_returncode is None else show_returncode

    def __call__(self, cmd, timeout):
        self.calls.append(list(cmd))
        if cmd[:2] == ["scontrol", "-o"]:
            return subprocess.CompletedProcess(cmd, self.show_returncode, self.show, "")
        return subprocess.CompletedProcess(cmd, self.returncode, "77\n", "denied")


def test_sbatch_resubmission_uses_the_jobs_script_and_workdir():
    s = SlurmEnv.from_env(slurm_env())
    runner = Recorder(show="JobId=42 Command=/jobs/train.sh --fast WorkDir=/scratch/me")
    cmd = requeue_command("sbatch", s, None, runner)
    assert cmd == ["sbatch", "--parsable", "--chdir=/scratch/me", "/jobs/train.sh", "--fast"]
    assert requeue_command("sbatch", s, Path("/other.sh"), runner)[-1] == "/other.sh"
    assert requeue_command("scontrol", s, None, runner) == ["scontrol", "requeue", "42"]


WORKER = """
import signal, sys, time
sig = signal.SIGUSR1
if sys.argv[1] == "saves":
    signal.pthread_sigmask(signal.SIG_BLOCK, {sig})
    print("ready", flush=True)
    signal.sigwait({sig})
    sys.exit(0)
signal.signal(sig, signal.SIG_IGN)
print("ready", flush=True)
time.sleep(60)
"""


@pytest.fixture
def workers(request):
    procs = []

    def start(kind: str, n: int = 2):
        for _ in range(n):
            p = subprocess.Popen([sys.executable, "-c", WORKER, kind], stdout=subprocess.PIPE,
                                 text=True)
            assert p.stdout.readline().strip() == "ready"
            procs.append(p)
        return procs

    term = signal.getsignal(signal.SIGTERM)
    yield start
    signal.signal(signal.SIGTERM, term)  # the handler takes SIGTERM over after a requeue
    for p in procs:
        if p.poll() is None:
            p.kill()
        p.wait()


def group_of(procs, run_dir: Path) -> GroupInfo:
    return GroupInfo(run_id="r", node_id="n0", run_dir=run_dir, round=0, group_rank=0,
                     group_world_size=1, restart_count=0,
                     workers=tuple(WorkerInfo(i, i, len(procs), p.pid)
                                   for i, p in enumerate(procs)))


def stopped_by_the_time_limit(handler: SlurmHandler, procs, run_dir: Path) -> StopRun:
    """What the handler's next check raises once the time-limit signal has come."""
    group = group_of(procs, run_dir)
    handler.on_workers_started(group)
    handler._on_signal(signal.SIGUSR1, None)
    with pytest.raises(StopRun) as stop:
        handler.check(group)
    return stop.value


@pytest.mark.timeout(60)
def test_time_limit_forwards_waits_for_saves_and_requeues(workers, tmp_path):
    procs = workers("saves")
    runner = Recorder()
    handler = SlurmHandler(SlurmConfig(), SlurmEnv.from_env(slurm_env()), event_dir=tmp_path,
                           node_id="n0", runner=runner)
    group = group_of(procs, tmp_path)
    handler.on_workers_started(group)
    assert handler.check(group) is None  # nothing happens before the signal
    handler._on_signal(signal.SIGUSR1, None)
    with pytest.raises(StopRun) as stop:
        handler.check(group)
    assert (stop.value.state, stop.value.exit_code) == ("requeued", 0)
    assert runner.calls == [["scontrol", "requeue", "42"]]
    assert all(p.wait(timeout=5) == 0 for p in procs)
    handler.close()
    kinds = {e["kind"]: e for e in read_events(tmp_path)}
    assert kinds["slurm_checkpoint"]["durable"] is True
    assert kinds["slurm_requeue"]["ok"] is True


@pytest.mark.timeout(60)
def test_time_limit_with_workers_that_ignore_it_still_requeues_but_says_so(workers, tmp_path):
    procs = workers("ignores")
    runner = Recorder()
    config = SlurmConfig(slurm_signal=SlurmSignal(lead_time=timedelta(seconds=2)))
    handler = SlurmHandler(config, SlurmEnv.from_env(slurm_env()), event_dir=tmp_path,
                           runner=runner)
    stop = stopped_by_the_time_limit(handler, procs, tmp_path)
    assert "NOT confirmed" in stop.reason and stop.state == "requeued"
    handler.close()
    event = next(e for e in read_events(tmp_path) if e["kind"] == "slurm_checkpoint")
    assert event["durable"] is False and "still running" in event["how"]


@pytest.mark.timeout(60)
def test_failed_requeue_is_a_failure_and_checkpoint_service_is_preferred(workers, tmp_path):
    class Service:
        def __init__(self):
            self.asked = []

        def checkpoint_now(self, reason, timeout):
            self.asked.append((reason, timeout))
            return True

    service = Service()
    procs = workers("ignores", n=1)
    handler = SlurmHandler(SlurmConfig(), SlurmEnv.from_env(slurm_env()), event_dir=tmp_path,
                           checkpointer=service, runner=Recorder(returncode=1))
    stop = stopped_by_the_time_limit(handler, procs, tmp_path)
    assert stop.state == "failed" and stop.exit_code == 1
    assert "requeue failed" in stop.reason and "denied" in stop.reason
    assert service.asked and service.asked[0][0] == "slurm time limit"
    assert procs[0].poll() is None  # the service saved; no signal was forwarded
    handler.close()


# SLURM_RESTART_COUNT is 1 in slurm_env(): Restarts=2 is this requeue's.
@pytest.mark.parametrize(
    ("returncode", "show", "show_returncode", "state"),
    [
        pytest.param(-15, "JobId=42 JobState=REQUEUED Restarts=2", 0, "requeued",
                     id="scontrol-ended-by-the-requeue's-SIGTERM"),
        pytest.param(-15, "JobId=42 JobState=RUNNING Restarts=1", 0, "failed",
                     id="ended-and-not-requeued"),
        pytest.param(1, "JobId=42 JobState=RUNNING Restarts=1", 0, "failed",
                     id="refused"),
        pytest.param(-15, "", 1, "failed", id="ended-and-the-job-unknown"),
        pytest.param(-15, "JobId=42 JobState=REQUEUED", 0, "failed", id="no-restart-count"),
    ],
)
@pytest.mark.timeout(60)
def test_a_requeue_whose_scontrol_fails_counts_only_when_the_job_shows_it(
        workers, tmp_path, returncode, show, show_returncode, state):
    procs = workers("saves", n=1)
    runner = Recorder(show=show, returncode=returncode, show_returncode=show_returncode)
    handler = SlurmHandler(SlurmConfig(), SlurmEnv.from_env(slurm_env()), event_dir=tmp_path,
                           runner=runner)
    stop = stopped_by_the_time_limit(handler, procs, tmp_path)
    assert stop.state == state
    assert runner.calls == [["scontrol", "requeue", "42"], ["scontrol", "-o", "show", "job", "42"]]
    handler.close()
    event = next(e for e in read_events(tmp_path) if e["kind"] == "slurm_requeue")
    assert event["ok"] is (state == "requeued")


@pytest.mark.parametrize(("procid", "submits"), [("0", True), ("2", False)])
@pytest.mark.timeout(60)
def test_only_the_first_node_resubmits_the_job_by_sbatch(workers, tmp_path, procid, submits):
    procs = workers("saves", n=1)
    runner = Recorder(show="JobId=42 Command=/jobs/train.sh WorkDir=/scratch/me")
    handler = SlurmHandler(SlurmConfig(slurm_requeue="sbatch"),
                           SlurmEnv.from_env(slurm_env(SLURM_PROCID=procid)),
                           event_dir=tmp_path, runner=runner)
    stop = stopped_by_the_time_limit(handler, procs, tmp_path)
    assert (stop.state, stop.exit_code) == ("requeued", 0)
    sbatch = [c for c in runner.calls if c[0] == "sbatch"]
    assert sbatch == ([["sbatch", "--parsable", "--chdir=/scratch/me", "/jobs/train.sh"]]
                      if submits else [])
    handler.close()


class GoneStore:
    """A round's store whose host has exited."""

    def set(self, key, value):
        raise RuntimeError("Connection reset by peer")


@pytest.mark.parametrize(
    ("group_rank", "others_saved", "store", "requeues", "missing"),
    [
        pytest.param(0, True, "hash", True, [], id="first-node-after-every-save"),
        pytest.param(0, False, "hash", True, [1], id="first-node-at-the-deadline"),
        pytest.param(1, True, "hash", False, None, id="another-node-leaves-it"),
        pytest.param(1, False, "gone", True, None, id="no-store-each-on-its-own"),
    ],
)
@pytest.mark.timeout(60)
def test_on_two_nodes_the_first_requeues_once_every_save_is_over(
        workers, tmp_path, group_rank, others_saved, store, requeues, missing):
    from torch.distributed import HashStore

    procs = workers("saves", n=1)
    runner = Recorder()
    config = SlurmConfig(slurm_signal=SlurmSignal(lead_time=timedelta(seconds=2)))
    handler = SlurmHandler(config, SlurmEnv.from_env(slurm_env()), event_dir=tmp_path,
                           runner=runner)
    group = dataclasses.replace(group_of(procs, tmp_path), group_rank=group_rank,
                                group_world_size=2)
    round_store = HashStore() if store == "hash" else GoneStore()
    if others_saved and store == "hash":
        round_store.set(f"elasticft.slurm.0.saved.{1 - group_rank}", "durable")
    handler.on_rendezvous(group, round_store)
    handler.on_workers_started(group)
    handler._on_signal(signal.SIGUSR1, None)
    with pytest.raises(StopRun) as stop:
        handler.check(group)
    assert (stop.value.state, stop.value.exit_code) == ("requeued", 0)
    assert (["scontrol", "requeue", "42"] in runner.calls) is requeues
    handler.close()
    met = [e["missing"] for e in read_events(tmp_path) if e["kind"] == "slurm_nodes_saved"]
    assert met == ([] if missing is None else [missing])


@pytest.mark.timeout(60)
def test_checkpoint_service_without_snapshot_falls_back_to_forwarding(workers, tmp_path):
    class EmptyService:
        def checkpoint_now(self, reason, timeout):
            return False  # a plain script: the service holds nothing

    procs = workers("saves")
    handler = SlurmHandler(SlurmConfig(), SlurmEnv.from_env(slurm_env()), event_dir=tmp_path,
                           checkpointer=EmptyService(), runner=Recorder())
    stop = stopped_by_the_time_limit(handler, procs, tmp_path)
    assert stop.state == "requeued" and "saved and exited" in stop.reason
    handler.close()
