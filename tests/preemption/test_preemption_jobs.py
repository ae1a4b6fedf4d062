"""A preemption announced mid-training ends a real job in a checkpoint and exit 75, and a
relaunch resumes from it bit-exact: once per mechanism, a cloud's metadata endpoint (a local
server answering as AWS documents it, named by --preempt-notices, which first recommends a
rebalance that training survives) and Kubernetes' SIGTERM with a grace period. What follows a
notice does not depend on the provider; Google Cloud's and Azure's endpoints are answered by the
same server in ``test_notices.py``. The uninterrupted reference run, shared by both, also shows
that where no notice source answers the launcher says nothing about it."""

from __future__ import annotations

import re
import signal
import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest

from elasticft.ckpt.persisting import durable
from elasticft.events import read_events
from elasticft.preemption import PREEMPTED_EXIT_CODE
from elasticft.report.tor import analyze
from elasticft.steps import read_steps
from tests.agent.test_launch import wait_until
from tests.conftest import BIN, EXAMPLES, clean_job_env, communicate_or_explain
from tests.preemption.metadata import MetadataServer
from tests.preemption.test_notices import _closed_port_url

pytestmark = pytest.mark.slow

STEPS = 50
# The first launch's steps last a second, so that a notice (and before it the rebalance save)
# lands mid-training even on a loaded machine; the relaunch and the reference do not wait (the
# step time is a sleep, which leaves the losses as they are).
TRAIN = [str(EXAMPLES / "train_elasticft.py"), "--steps", str(STEPS), "--layers", "1",
         "--dim", "32", "--step-time", "1"]
NO_WAIT = ("--step-time", "0")


def _command(notices: str, *extra: str) -> list[str]:
    return [str(BIN / "elasticft-run"), "--standalone", "--nproc-per-node", "2",
            "--monitor-interval", "0.2", "--preempt-notices", notices, *extra, *TRAIN]


def _losses(path: Path) -> dict[int, str]:
    lines = (line.split() for line in path.read_text().splitlines())
    return {int(step): loss for step, loss in lines}


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> dict[int, str]:
    """The losses of an uninterrupted run (no notice source answers it)."""
    cwd = tmp_path_factory.mktemp("reference")
    out = subprocess.run([*_command(_closed_port_url()), "--loss-log", str(cwd / "loss"),
                          *NO_WAIT],
                         env=clean_job_env(), cwd=cwd, capture_output=True, text=True,
                         timeout=300)
    text = out.stdout + out.stderr
    assert out.returncode == 0, text[-4000:]
    # No noise where nothing answers: the one DEBUG line is below the launcher's INFO level.
    assert not re.search(r"preempt|metadata", text, flags=re.I), text[-4000:]
    losses = _losses(cwd / "loss")
    assert sorted(losses) == list(range(1, STEPS + 1))
    return losses


def _preempted_then_resumed(cwd: Path, command: list[str], env: dict[str, str],
                            announce: Callable[[subprocess.Popen], float],
                            reference: dict[int, str],
                            new_machine: Callable[[], None] = lambda: None,
                            remote: Path | None = None) -> list[dict]:
    """Runs ``command`` until step 4, ``announce``s the preemption (returns its deadline), checks
    the exit and the save (on disk, and in ``remote`` when given), relaunches (on a
    ``new_machine``) and checks its bit-exact resume; returns the first run's events."""
    first = subprocess.Popen([*command, "--loss-log", str(cwd / "loss-1")], env=env, cwd=cwd,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        wait_until(lambda: (cwd / "loss-1").exists()
                   and len((cwd / "loss-1").read_text().splitlines()) >= 4, 240, "four steps")
        deadline = announce(first)
        out, err = communicate_or_explain(first, 180)
    finally:
        if first.poll() is None:
            first.kill()
            first.wait()
    text = out + err
    assert first.returncode == PREEMPTED_EXIT_CODE, text[-4000:]
    assert "preempted" in text, text[-4000:]
    (run_dir,) = (cwd / "elasticft-runs").iterdir()
    events = read_events(run_dir)
    decision = [e for e in events if e["kind"] == "preemption_decision"][-1]
    assert decision["action"] == "save_and_stop" and decision["facts"]["worker_api"]
    saved = [e for e in events if e["kind"] == "preemption_saved"][-1]
    assert saved["durable"] and saved["step"] >= 1 and saved["before_deadline_s"] > 0, saved
    end = next(e for e in events if e["kind"] == "run_end")
    assert (end["state"], end["exit_code"]) == ("preempted", PREEMPTED_EXIT_CODE)
    assert end["time"] < deadline  # out before the machine goes
    for place in (run_dir / "ckpt", *([remote] if remote else [])):
        assert saved["step"] in durable.committed_steps(place), place
    trained = max(_losses(cwd / "loss-1"))
    assert trained < STEPS, "the notice came after the end of training"

    new_machine()
    second = subprocess.run([*command, "--loss-log", str(cwd / "loss-2"), *NO_WAIT],
                            env=env, cwd=cwd,
                            capture_output=True, text=True, timeout=300)
    text = second.stdout + second.stderr
    assert second.returncode == 0, text[-4000:]
    resumed = int(re.search(r"resumed from step (\d+) \(source=local\)", text)[1])
    assert saved["step"] <= resumed <= trained, (saved, resumed, trained)
    again = _losses(cwd / "loss-2")
    assert sorted(again) == list(range(resumed + 1, STEPS + 1))
    assert again == {step: reference[step] for step in again}  # bit-exact
    # The report spans both launches and counts the preemption, not a failure.
    report = analyze(read_events(run_dir), read_steps(run_dir))
    assert report.allocations == 2 and report.faults == [] and report.last_step == STEPS
    assert report.preemptions[-1].action == "save_and_stop" and report.preemptions[-1].durable
    return events


@pytest.mark.timeout(600)
def test_a_cloud_notice_saves_exits_75_and_the_relaunch_resumes_bit_exact(
        tmp_path: Path, reference: dict[int, str]) -> None:
    server = MetadataServer("aws", lead_s=90)

    def announce(job: subprocess.Popen) -> float:
        server.rebalance()  # first a rebalance recommendation, which training survives
        wait_until(lambda: any(e["kind"] == "preemption_saved" for e in read_events(
            tmp_path / "elasticft-runs")), 120, "the save on the rebalance recommendation")
        return server.preempt()

    remote = tmp_path / "remote"  # storage a new machine would see too
    try:
        events = _preempted_then_resumed(
            tmp_path, _command(server.url, "--ckpt-remote-dir", str(remote)), clean_job_env(),
            announce, reference, new_machine=server.replace_machine, remote=remote)
    finally:
        server.close()

    notices = [(e["provider"], e["notice"]) for e in events if e["kind"] == "preemption_notice"]
    actions = [e["action"] for e in events if e["kind"] == "preemption_decision"]
    assert notices == [("aws", "rebalance"), ("aws", "termination")]
    assert actions == ["persist_and_continue", "save_and_stop"]


@pytest.mark.timeout(600)
def test_sigterm_in_a_kubernetes_pod_saves_within_the_grace_period(
        tmp_path: Path, reference: dict[int, str]) -> None:
    env = {**clean_job_env(), "KUBERNETES_SERVICE_HOST": "10.96.0.1"}

    def terminate(job: subprocess.Popen) -> float:
        import time

        job.send_signal(signal.SIGTERM)  # what the kubelet sends the container's process
        return time.time() + 60

    events = _preempted_then_resumed(
        tmp_path, _command(_closed_port_url(), "--preempt-grace-s", "60"), env, terminate,
        reference)
    notice = next(e for e in events if e["kind"] == "preemption_notice")
    assert notice["provider"] == "kubernetes" and "grace period 60 s" in notice["detail"]
