"""elasticft-run end to end on real gloo workers: environment parity with torchrun, recovery
from a SIGKILLed worker, no restart of a user bug, SIGTERM to the launcher, unhealthy groups."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from elasticft.chaos import ChaosError, signal_rank, worker_pid
from elasticft.events import read_events
from tests.conftest import BIN, EXAMPLES, communicate_or_explain

pytestmark = pytest.mark.slow
HERE = Path(__file__).parent
TRAIN = str(EXAMPLES / "train_plain.py")


def launcher(args: list[str], env: dict[str, str], cwd: Path, tool: str = "elasticft-run"):
    # torchrun's default log directory is a new /tmp/torchelastic_* that nobody removes.
    logs = ["--log-dir", str(cwd / "torchrun-logs")] if tool == "torchrun" else []
    return subprocess.Popen(
        [str(BIN / tool), *logs, *args], env=env, cwd=cwd, stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True, start_new_session=True,
    )


def losses(path: Path) -> dict[int, float]:
    """Step -> loss; a step recomputed after a restart keeps its last value."""
    table: dict[int, float] = {}
    if path.exists():
        for line in path.read_text().splitlines():
            step, value = line.split()
            table[int(step)] = float(value)
    return table


def _running_pids(run_dir: Path, ranks: int) -> set[int | None]:
    """The pids of the ranks' current workers; None for one that is not running."""
    pids: set[int | None] = set()
    for rank in range(ranks):
        try:
            pids.add(worker_pid(run_dir, rank))
        except ChaosError:
            pids.add(None)
    return pids


def wait_until(predicate, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.1)


@pytest.mark.smoke
@pytest.mark.timeout(180)
def test_worker_environment_matches_torchrun(tmp_path: Path, job_env: dict[str, str]) -> None:
    envs = {}
    # Both launchers run at once: each is a separate standalone job on its own port.
    procs = {tool: launcher(["--standalone", "--nproc-per-node", "2",
                             str(HERE / "workers" / "dump_env.py"), str(tmp_path / tool)],
                            job_env, tmp_path, tool)
             for tool in ("torchrun", "elasticft-run")}
    for tool, proc in procs.items():
        _, stderr = proc.communicate(timeout=120)
        assert proc.returncode == 0, stderr
        envs[tool] = [json.loads((tmp_path / tool / f"env-{r}.json").read_text())
                      for r in (0, 1)]

    run_specific = {"MASTER_PORT", "TORCHELASTIC_RUN_ID", "TORCHELASTIC_ERROR_FILE"}
    for rank in (0, 1):
        plain, ours = envs["torchrun"][rank], envs["elasticft-run"][rank]
        added = set(ours) - set(plain)
        assert set(plain) - set(ours) == set(), "elasticft-run must not drop a variable"
        # Diagnostics put their bootstrap first on PYTHONPATH (elasticft.diag.workerenv).
        ours_only = added - {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "PYTHONPATH"}
        assert all(k.startswith("ELASTICFT_") for k in ours_only), ours_only
        assert {"ELASTICFT_RUN_DIR", "ELASTICFT_NODE_ID", "ELASTICFT_ROUND"} <= added
        differing = {k for k in plain if plain[k] != ours[k]} - run_specific - {"PYTHONPATH"}
        if "PYTHONPATH" in plain:  # the launching environment had one: kept, after the bootstrap
            assert ours["PYTHONPATH"].endswith(os.pathsep + plain["PYTHONPATH"]), ours["PYTHONPATH"]
        # The store is an agent's under both (elasticft's a fresh one each round instead of
        # the handler's shared one, which keeps stale gloo addresses: pytorch#135712).
        assert differing == set(), differing
        assert ours["TORCHELASTIC_USE_AGENT_STORE"] == "True"
        for key in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK",
                    "ROLE_RANK", "MASTER_ADDR", "TORCHELASTIC_RESTART_COUNT", "OMP_NUM_THREADS"):
            assert plain[key] == ours[key], key


@pytest.mark.smoke
@pytest.mark.timeout(300)
def test_sigkilled_worker_recovers_and_matches_uninterrupted_losses(
    tmp_path: Path, job_env: dict[str, str]
) -> None:
    steps = 24
    reference = tmp_path / "reference.txt"
    # The uninterrupted reference runs alongside the faulty run (which mostly sleeps in
    # --step-time) and is read once that one is done.
    ref = launcher(["--standalone", "--nproc-per-node", "2", TRAIN, "--steps", str(steps),
                    "--ckpt-dir", str(tmp_path / "ref-ckpt"), "--loss-log", str(reference)],
                   job_env, tmp_path)

    run_dir, loss_log = tmp_path / "run", tmp_path / "losses.txt"
    proc = launcher(
        ["--standalone", "--nproc-per-node", "2", "--max-restarts", "5", "--run-dir",
         str(run_dir), TRAIN, "--steps", str(steps), "--ckpt-every", "3", "--step-time",
         "0.15", "--ckpt-dir", str(tmp_path / "ckpt"), "--loss-log", str(loss_log)],
        job_env, tmp_path,
    )
    killed = []
    for cycle, at_step in enumerate((5, 11, 17)):
        wait_until(lambda s=at_step: max(losses(loss_log), default=0) >= s, 120,
                   f"step {at_step}")
        killed.append(signal_rank(run_dir, cycle % 2, signal.SIGKILL))
        wait_until(lambda: _running_pids(run_dir, 2).isdisjoint({None, *killed}), 60,
                   "restarted workers")
    _, stderr = proc.communicate(timeout=180)
    assert proc.returncode == 0, stderr
    assert "succeeded (exit code 0)" in stderr and "3 restart(s)" in stderr
    _, ref_stderr = ref.communicate(timeout=150)
    assert ref.returncode == 0, ref_stderr

    events = read_events(run_dir)
    failures = [e for e in events if e["kind"] == "failure"]
    assert [f["failure_class"] for f in failures] == ["signal_crash"] * 3
    assert [e["action"] for e in events if e["kind"] == "decision"] == ["restart_in_place"] * 3
    assert [e["kind"] for e in events][-1] == "run_end"
    got, want = losses(loss_log), losses(reference)
    assert sorted(got) == list(range(1, steps + 1))
    for step in want:
        assert got[step] == pytest.approx(want[step], abs=1e-4), step


@pytest.mark.timeout(180)
def test_user_code_error_stops_without_restart(tmp_path: Path, job_env: dict[str, str]) -> None:
    run_dir = tmp_path / "run"
    proc = launcher(
        ["--standalone", "--nproc-per-node", "2", "--max-restarts", "3", "--run-dir",
         str(run_dir), TRAIN, "--steps", "10", "--ckpt-dir", str(tmp_path / "ckpt"),
         "--user-error-at-step", "3", "--fault-rank", "1"], job_env, tmp_path,
    )
    _, stderr = proc.communicate(timeout=150)
    assert proc.returncode == 1
    summary = stderr[stderr.index("elasticft: run"):]
    assert "0 restart(s)" in summary
    assert "rank 1 (user_code) ZeroDivisionError: division by zero" in summary
    assert "train_plain.py:" in summary
    # A failure that stops the run shows its traceback in full (agent/console.py).
    console = stderr[:stderr.index("elasticft: run")]
    assert "Traceback (most recent call last):" in console, console[-3000:]
    assert "ZeroDivisionError: division by zero" in console, console[-3000:]
    kinds = [e["kind"] for e in read_events(run_dir)]
    assert kinds.count("workers_started") == 1 and "restart" not in kinds


@pytest.mark.timeout(120)
def test_a_bug_whose_worker_exits_after_its_peers_report_is_still_not_restarted(
        tmp_path: Path, job_env: dict[str, str]) -> None:
    # Rank 1 prints its ZeroDivisionError, closes its group and lingers: rank 0 fails first (gloo's
    # "connection closed") and the agent stops rank 1 with SIGTERM. Under load this is what a
    # slow exit does; here it happens every time.
    run_dir = tmp_path / "run"
    proc = launcher(["--standalone", "--nproc-per-node", "2", "--max-restarts", "3",
                     "--run-dir", str(run_dir), str(HERE / "workers" / "linger_after_error.py")],
                    job_env, tmp_path)
    _, stderr = communicate_or_explain(proc, 90)
    assert proc.returncode == 1, stderr[-3000:]
    summary = stderr[stderr.index("elasticft: run"):]
    assert "0 restart(s)" in summary, summary
    assert "rank 1 (user_code) ZeroDivisionError: division by zero" in summary, summary
    failures = {e["rank"]: e["failure_class"] for e in read_events(run_dir)
                if e["kind"] == "failure"}
    assert failures == {0: "infrastructure", 1: "user_code"}, failures


@pytest.mark.smoke
@pytest.mark.timeout(180)
def test_sigterm_to_launcher_stops_workers_within_shutdown_timeout(
    tmp_path: Path, job_env: dict[str, str]
) -> None:
    pid_dir, run_dir = tmp_path / "pids", tmp_path / "run"
    proc = launcher(
        ["--standalone", "--nproc-per-node", "2", "--max-restarts", "3", "--shutdown-timeout",
         "2", "--run-dir", str(run_dir), str(HERE / "workers" / "ignore_sigterm.py"),
         str(pid_dir)], job_env, tmp_path,
    )
    wait_until(lambda: len(list(pid_dir.glob("pid-*"))) == 2, 90, "workers to start")
    workers = [int(p.read_text()) for p in pid_dir.glob("pid-*")]
    proc.send_signal(signal.SIGTERM)
    _, stderr = communicate_or_explain(proc, 60)
    assert proc.returncode == 128 + signal.SIGTERM, stderr
    assert "received SIGTERM" in stderr
    # The workers ignore SIGTERM: only the SIGKILL after --shutdown-timeout (2 s) stops them.
    # torch's own default is 30 s. Which one the launcher used shows in its own log, between
    # its SIGTERM and its SIGKILL (not in the test's clock, which a loaded host stretches).
    assert _seconds_from_term_to_kill(stderr) < 15, stderr
    for pid in workers:
        assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    kinds = [e["kind"] for e in read_events(run_dir)]
    assert "restart" not in kinds and kinds[-1] == "run_end"


def _seconds_from_term_to_kill(log: str) -> float:
    """Seconds between torch's first "closing signal SIGTERM" line and its first "forcefully
    exiting" (SIGKILL) line, from their glog time stamps."""
    stamps: dict[str, float] = {}
    for line in log.splitlines():
        found = re.match(r"[IWE]\d{4} (\d\d):(\d\d):(\d\d\.\d+) ", line)
        what = "term" if "closing signal SIGTERM" in line else \
            "kill" if "forcefully exiting" in line else None
        if found and what and what not in stamps:
            h, m, sec = found.groups()
            stamps[what] = int(h) * 3600 + int(m) * 60 + float(sec)
    assert set(stamps) == {"term", "kill"}, log
    return (stamps["kill"] - stamps["term"]) % 86400


def launch_with_collaborator(tmp_path: Path, collaborator: str, nproc: int, max_restarts: int,
                             timeout: float) -> subprocess.CompletedProcess[str]:
    """Runs elasticft's launch() in a fresh interpreter over sleeping workers, with the class
    ``Scripted`` defined by ``collaborator`` (source code) as the agent's only collaborator."""
    code = f"""
import os, signal, sys, time
from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs
from torch.distributed.launcher.api import LaunchConfig
from elasticft.addon.api import AgentCollaborator, Detection
from elasticft.addon.classify import FailureClass
from elasticft.config import AgentConfig, ElasticftConfig
from elasticft.launcher import launch

{collaborator}

config = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node={nproc}, run_id="scripted",
                      rdzv_backend="c10d", rdzv_endpoint="localhost:0",
                      max_restarts={max_restarts}, monitor_interval=0.2,
                      logs_specs=DefaultLogsSpecs(log_dir={str(tmp_path / 'logs')!r}))
options = ElasticftConfig(agent=AgentConfig(run_dir={str(tmp_path / 'run')!r}))
result = launch(config, sys.executable, ["-u", {str(HERE / 'workers' / 'sleep_forever.py')!r}],
                options, collaborators=[Scripted()])
print(result.summary(), file=sys.stderr)
sys.exit(result.exit_code)
"""
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, "PYTHONUNBUFFERED": "1"})


@pytest.mark.timeout(120)
def test_unhealthy_group_with_no_restarts_left_exits_non_zero(tmp_path: Path) -> None:
    """torch's launcher exits 0 here (its RunResult is UNHEALTHY, not FAILED)."""
    proc = launch_with_collaborator(tmp_path, """
class Scripted(AgentCollaborator):  # declares a hang
    def check(self, group):
        return Detection(FailureClass.HANG, (1,), "scripted", "rank 1 made no progress")
""", nproc=2, max_restarts=0, timeout=100)
    assert proc.returncode == 1, proc.stderr
    assert "no restarts left" in proc.stderr and "rank 1 (hang)" in proc.stderr


@pytest.mark.timeout(120)
def test_sigterm_inside_a_collaborator_hook_still_stops_the_launcher(tmp_path: Path) -> None:
    """torch raises SIGTERM as an exception wherever the agent's main thread is; a hook that
    catches its own errors must not swallow it (the launcher and workers would run on)."""
    proc = launch_with_collaborator(tmp_path, """
class Scripted(AgentCollaborator):  # signalled while checking
    def check(self, group):
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.5)  # the handler raises here, inside the hook
        return None
""", nproc=1, max_restarts=3, timeout=60)
    assert proc.returncode == 128 + signal.SIGTERM, proc.stderr
    assert "received SIGTERM" in proc.stderr
    assert "failed in check" not in proc.stderr


@pytest.mark.timeout(120)
def test_a_sigterm_after_the_run_ended_on_purpose_leaves_its_outcome(tmp_path: Path) -> None:
    """A Slurm requeue SIGTERMs the job it just requeued, often while the launcher closes the
    run: the run still ends as requeued, with exit code 0."""
    proc = launch_with_collaborator(tmp_path, """
from elasticft.addon.api import StopRun

class Scripted(AgentCollaborator):  # ends the run, then is signalled while closing
    def check(self, group):
        raise StopRun("requeued", "scripted requeue", exit_code=0)

    def close(self):
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.5)  # a raised signal would interrupt this
""", nproc=1, max_restarts=0, timeout=100)
    assert proc.returncode == 0, proc.stderr
    assert "requeued" in proc.stderr and "received SIGTERM" not in proc.stderr


def test_a_signal_during_the_clean_up_is_noted_not_raised() -> None:
    from elasticft.launcher import _signals_noted

    before = signal.getsignal(signal.SIGTERM)
    with _signals_noted() as noted:
        os.kill(os.getpid(), signal.SIGTERM)
        wait_until(lambda: noted == [signal.SIGTERM], 10, "the signal to be noted")
    assert signal.getsignal(signal.SIGTERM) is before


TRAIN_WITH_A_BAD_VALUE = """\
import torch.distributed as dist

dist.init_process_group("gloo")
if dist.get_rank() == 1:
    raise ValueError("bad config value")
dist.barrier()
"""


@pytest.mark.timeout(240)
def test_the_python_api_example_runs_as_written(tmp_path: Path, job_env: dict[str, str]) -> None:
    """docs/launcher.md's launch() example, over a train.py whose rank 1 raises a user error:
    classified and decided as elasticft-run does (stop, no restart), the pager paged."""
    docs = (HERE.parent.parent / "docs" / "launcher.md").read_text()
    api = docs[docs.index("**Python API.**"):]
    example = api[api.index("```python\n") + len("```python\n"):]
    (tmp_path / "example.py").write_text(example[:example.index("```")])
    (tmp_path / "train.py").write_text(TRAIN_WITH_A_BAD_VALUE)
    env = {**job_env, "PATH": f"{BIN}{os.pathsep}{job_env.get('PATH', '')}"}  # its "python"
    proc = subprocess.run([sys.executable, "example.py"], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=200)
    assert proc.returncode == 0, proc.stderr[-5000:]
    assert "run job1 failed (exit code 1)" in proc.stdout and "0 restart(s)" in proc.stdout
    assert "rank 1 (user_code) ValueError: bad config value at " in proc.stdout
    assert "train.py:5 in <module>" in proc.stdout
    assert "paging on-call: user-code error, not restarted" in proc.stderr
    events = read_events(tmp_path / "elasticft-runs" / "job1")
    assert [e["action"] for e in events if e["kind"] == "decision"] == ["stop"]
    assert any(e["kind"] == "workers_started" for e in events)
