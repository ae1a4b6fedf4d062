"""The Python API decides as elasticft-run does: the same failures, run under ``elasticft-run``,
under ``elasticft.launch`` with a script and with a function entrypoint, on real gloo workers,
end with the same failure class and the same decisions."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from elasticft.events import read_events
from tests.conftest import BIN, ROOT

pytestmark = pytest.mark.slow
PARITY = Path(__file__).parent / "workers" / "parity.py"

# case -> (the failure's class, the decisions in order, the launcher's exit code)
EXPECTED = {
    "user_error": ("user_code", ["stop"], 1),
    "kill": ("signal_crash", ["restart_in_place"], 0),
    "hang": ("hang", ["restart_in_place"], 0),
}


def run_cli(case: str, run_dir: Path, env: dict[str, str], cwd: Path
            ) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(BIN / "elasticft-run"), "--standalone", "--nproc-per-node", "2", "--max-restarts",
         "1", "--run-dir", str(run_dir), str(PARITY), case],
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
                      rdzv_backend="c10d", rdzv_endpoint="localhost:0", max_restarts=1)
options = ElasticftConfig(agent=AgentConfig(run_dir={str(run_dir)!r}))
result = launch(config, {entry}, options)
print(result.summary(), file=sys.stderr)
sys.exit(result.exit_code)
"""
    return subprocess.run([sys.executable, "-c", code], env=env, cwd=cwd, capture_output=True,
                          text=True, timeout=240)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("launcher", ["elasticft-run", "launch-script", "launch-function"])
@pytest.mark.parametrize("case", list(EXPECTED))
def test_same_class_and_decision(case: str, launcher: str, tmp_path: Path,
                                 job_env: dict[str, str]) -> None:
    run_dir = tmp_path / "run"
    if launcher == "elasticft-run":
        proc = run_cli(case, run_dir, job_env, tmp_path)
    else:
        proc = run_launch(case, run_dir, job_env, tmp_path,
                          function=launcher == "launch-function")
    cls, decisions, exit_code = EXPECTED[case]
    assert proc.returncode == exit_code, proc.stderr[-5000:]
    events = read_events(run_dir)
    failures = [e for e in events if e["kind"] == "failure"]
    # Rank 1's failure has the case's class. Rank 0 may fail too, as its consequence: its
    # collective with rank 1 raises (a communication error), or the agent stops it.
    caused = [f for f in failures if f["rank"] == 1]
    assert caused and caused[0]["failure_class"] == cls, failures
    assert all(f["failure_class"] in ("infrastructure", "stop_requested")
               for f in failures if f["rank"] != 1), failures
    assert [e["action"] for e in events if e["kind"] == "decision"] == decisions
    restarts = [e["restarts"] for e in events if e["kind"] == "run_end"]
    assert restarts == [len(decisions) if exit_code == 0 else 0]
    if case == "user_error":
        assert "rank 1 (user_code) ValueError: bad config value" in proc.stderr
        assert "parity.py:" in caused[0]["location"]
    if case == "hang":
        assert "hang (frozen): rank 1 frozen" in caused[0]["message"]
