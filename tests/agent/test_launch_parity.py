"""The Python API decides as elasticft-run does: the same failures, run under ``elasticft-run``,
under ``elasticft.launch`` with a script and with a function entrypoint, on real gloo workers,
end with the same failure class and the same decisions.

Each launcher runs the table once: rank 1 fails on each attempt with the next failure of
``parity.TABLE`` (a SIGKILL, a hang, a user-code error), so one job holds every row; the rows
are judged one by one from its event log."""

from __future__ import annotations

import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from elasticft.events import read_events
from tests.agent.workers.parity import TABLE
from tests.conftest import BIN, ROOT, clean_job_env

pytestmark = pytest.mark.slow
PARITY = Path(__file__).parent / "workers" / "parity.py"
LAUNCHERS = ["elasticft-run", "launch-script", "launch-function"]

# case -> (the failure's class, the decision on it)
EXPECTED = {
    "kill": ("signal_crash", "restart_in_place"),
    "hang": ("hang", "restart_in_place"),
    "user_error": ("user_code", "stop"),
}
# One restart more than the table uses, so the user-code error's stop is its class's decision,
# not an exhausted budget.
MAX_RESTARTS = len(TABLE)


def run_cli(case: str, run_dir: Path, env: dict[str, str], cwd: Path
            ) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(BIN / "elasticft-run"), "--standalone", "--nproc-per-node", "2", "--max-restarts",
         str(MAX_RESTARTS), "--run-dir", str(run_dir), str(PARITY), case],
        env=env, cwd=cwd, capture_output=True, text=True, timeout=240)


def run_launch(case: str, run_dir: Path, env: dict[str, str], cwd: Path, *, function: bool
               ) -> subprocess.CompletedProcess[str]:
    """``elasticft.launch`` with torch's default LaunchConfig logs (nothing captured), as a
    user's own launcher calls it."""
    entry = ("parity.main, (case,)" if function
             else "sys.executable, ['-u', parity.__file__, case]")
    code = f"""
import sys
sys.path.insert(0, {str(ROOT)!r})
from torch.distributed.launcher.api import LaunchConfig
from elasticft import ElasticftConfig, launch
from elasticft.config import AgentConfig
from tests.agent.workers import parity

case = {case!r}
config = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=2, run_id="parity",
                      rdzv_backend="c10d", rdzv_endpoint="localhost:0",
                      max_restarts={MAX_RESTARTS})
options = ElasticftConfig(agent=AgentConfig(run_dir={str(run_dir)!r}))
result = launch(config, {entry}, options)
print(result.summary(), file=sys.stderr)
sys.exit(result.exit_code)
"""
    return subprocess.run([sys.executable, "-c", code], env=env, cwd=cwd, capture_output=True,
                          text=True, timeout=240)


@dataclass(frozen=True)
class TableRun:
    """One launcher's run of the whole table: the launcher process and the job's events."""

    proc: subprocess.CompletedProcess[str]
    events: list[dict[str, Any]]


class TableRuns(dict[str, TableRun]):
    """Each launcher's run of the table, launched the first time a test asks for it (so a
    selection of one launcher's rows launches that one only)."""

    def __init__(self, tmp_path_factory: pytest.TempPathFactory) -> None:
        super().__init__()
        self.tmp_path_factory = tmp_path_factory

    def __missing__(self, launcher: str) -> TableRun:
        cwd = self.tmp_path_factory.mktemp(launcher)
        run_dir = cwd / "run"
        if launcher == "elasticft-run":
            proc = run_cli("table", run_dir, clean_job_env(), cwd)
        else:
            proc = run_launch("table", run_dir, clean_job_env(), cwd,
                              function=launcher == "launch-function")
        self[launcher] = TableRun(proc, read_events(run_dir))
        return self[launcher]


@pytest.fixture(scope="module")
def table_runs(tmp_path_factory: pytest.TempPathFactory) -> TableRuns:
    return TableRuns(tmp_path_factory)


@pytest.mark.timeout(400)
@pytest.mark.parametrize("launcher", LAUNCHERS)
def test_the_table_restarts_after_each_fault_and_stops_on_the_user_error(
        launcher: str, table_runs: TableRuns) -> None:
    run = table_runs[launcher]
    assert run.proc.returncode == 1, run.proc.stderr[-5000:]
    decisions = [e for e in run.events if e["kind"] == "decision"]
    assert [(e["attempt"], e["action"]) for e in decisions] == [
        (attempt, EXPECTED[case][1]) for attempt, case in enumerate(TABLE)], decisions
    restarts = [e["restarts"] for e in run.events if e["kind"] == "run_end"]
    assert restarts == [len(TABLE) - 1]


@pytest.mark.timeout(400)
@pytest.mark.parametrize("launcher", LAUNCHERS)
@pytest.mark.parametrize("case", list(EXPECTED))
def test_same_class_and_decision(case: str, launcher: str,
                                 table_runs: TableRuns) -> None:
    run = table_runs[launcher]
    attempt = TABLE.index(case)
    cls, decision = EXPECTED[case]
    failures = [e for e in run.events if e["kind"] == "failure" and e["attempt"] == attempt]
    # Rank 1's failure has the case's class. Rank 0 may fail too, as its consequence: its
    # collective with rank 1 raises (a communication error), or the agent stops it.
    caused = [f for f in failures if f["rank"] == 1]
    assert caused and caused[0]["failure_class"] == cls, failures
    assert all(f["failure_class"] in ("infrastructure", "stop_requested")
               for f in failures if f["rank"] != 1), failures
    decided = [e for e in run.events if e["kind"] == "decision" and e["attempt"] == attempt]
    assert [e["action"] for e in decided] == [decision], decided
    if case == "user_error":
        assert "rank 1 (user_code) ValueError: bad config value" in run.proc.stderr
        assert "parity.py:" in caused[0]["location"]
        assert decided[0]["reason"].startswith("user-code error, not restarted"), decided
    if case == "hang":
        assert "hang (frozen): rank 1 frozen" in caused[0]["message"]
