"""A Slurm time-limit signal that comes while the launcher starts (before torch is imported and
the handler installed) is kept for the handler, not the end of the job; another held signal
still ends the launcher. Real signals, in processes of their own (a signal delivered again
would end pytest's)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from elasticft.events import read_events
from tests.conftest import EXAMPLES, free_port

pytestmark = pytest.mark.timeout(120)

SLURM_JOB = {"SLURM_JOB_ID": "42", "SLURM_JOB_NODELIST": "127.0.0.1", "SLURM_NODEID": "0"}

HOLD = """
import os, signal, sys, time
from elasticft import slurm
slurm.hold_time_limit_signals(os.environ)
for name in sys.argv[1].split(",") if sys.argv[1] else []:
    os.kill(os.getpid(), getattr(signal, name))
time.sleep(0.05)
"""

ADOPT = HOLD + """
from elasticft.config import SlurmConfig
handler = slurm.SlurmHandler(SlurmConfig(), slurm.SlurmEnv.from_env(os.environ))
handler.install()
print("seen", handler._signal_seen.is_set(), handler._signalled_at is not None
      and handler._signalled_at <= time.monotonic() - 0.05,
      "own", signal.getsignal(signal.SIGUSR1) == handler._on_signal,
      "usr2", signal.getsignal(signal.SIGUSR2) is signal.SIG_DFL, flush=True)
"""

RELEASE = HOLD + """
print("released", slurm.release_held_signals(keep=signal.SIGUSR1), flush=True)
"""


def python(code: str, sent: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", code, sent], capture_output=True, text=True,
                          timeout=60, env={**os.environ, **env})


@pytest.mark.parametrize(
    ("code", "sent", "env", "returncode", "printed"),
    [
        pytest.param(ADOPT, "SIGUSR1", SLURM_JOB, 0, "seen True True own True usr2 True",
                     id="time-limit-signal-taken-over"),
        pytest.param(ADOPT, "", SLURM_JOB, 0, "seen False False own True usr2 True",
                     id="nothing-came"),
        pytest.param(RELEASE, "SIGUSR2", SLURM_JOB, -signal.SIGUSR2, "",
                     id="another-signal-ends-it-at-the-release"),
        pytest.param(RELEASE, "", SLURM_JOB, 0, "released None", id="released-quietly"),
        pytest.param(RELEASE, "SIGUSR1", {}, -signal.SIGUSR1, "", id="outside-slurm-no-hold"),
    ],
)
def test_signals_held_from_the_first_line(code, sent, env, returncode, printed):
    done = python(code, sent, env)
    assert done.returncode == returncode, done.stderr[-2000:]
    assert done.stdout.strip() == printed, done.stderr[-2000:]


DRIVER = """
import os, signal, sys
from elasticft import run, slurm
# The signal comes in the start-up window: after main()'s first line would hold it, before the
# launcher imports torch and installs the handler (held here first, as main() does).
slurm.hold_time_limit_signals(os.environ)
os.kill(os.getpid(), signal.SIGUSR1)
sys.exit(run.main(sys.argv[1:]))
"""


def test_a_launcher_signalled_before_its_handler_checkpoints_and_ends_by_the_time_limit(
        tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    done = subprocess.run(
        [sys.executable, "-c", DRIVER, "--nnodes", "1", "--nproc-per-node", "1",
         "--master-addr", "127.0.0.1", "--master-port", str(free_port()),
         "--slurm-requeue", "off", "--slurm-signal", "B:USR1@30", "--run-dir", str(run_dir),
         str(EXAMPLES / "train_plain.py"), "--steps", "600", "--step-time", "0.1",
         "--ckpt-dir", str(tmp_path / "ckpt")],
        capture_output=True, text=True, timeout=100, env={**os.environ, **SLURM_JOB})
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-3000:]  # before the hold: -SIGUSR1, the job lost
    assert "SIGUSR1 came" in output and "while the launcher started" in output, output[-3000:]
    events = read_events(run_dir)
    (limit,) = [e for e in events if e["kind"] == "slurm_time_limit"]
    assert limit["signalled_s_ago"] > 0, limit
    (requeue,) = [e for e in events if e["kind"] == "slurm_requeue"]
    assert requeue["how"] == "off", requeue
    assert [e["state"] for e in events if e["kind"] == "run_end"] == ["time_limit"], output[-3000:]
