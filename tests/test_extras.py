"""A missing optional dependency ends every entry point with one line naming the extra to
install and exit code 2. Each case runs the real entry point in a process of its own in which
the package is made unimportable (``sys.modules[name] = None``, as Python does for a blocked
import) or the program unfindable: the cases that block what torch does not import each in a
process forked from one interpreter that imported torch once (``FORK_SERVER``), which spares each
a ~2 s torch import (each case checks that what it blocks was not imported before), the others
in a fresh interpreter."""

from __future__ import annotations

import json
import select
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from elasticft.extras import MissingExtra
from tests.conftest import BIN, ROOT

WORKER = Path(__file__).parent / "agent" / "workers" / "sleep_forever.py"
ETCD_ARGS = ["--nnodes", "1", "--nproc-per-node", "1", "--rdzv-backend", "etcd-v3",
             "--rdzv-endpoint", "127.0.0.1:1", "--rdzv-id", "job", str(WORKER)]

# The entry point's main, called after hiding ``BLOCK``.
RUNNER = """
import runpy, sys
for name in {block!r}:
    assert sys.modules.get(name) is None, f"{{name}} was imported before it was blocked"
    sys.modules[name] = None
{setup}
sys.argv = {argv!r}
runpy.run_path({script!r}, run_name="__main__")
"""

# Reads one case a line ({"code", "env", "cwd", "stdout", "stderr"}) and answers each with the
# exit status of RUNNER's code run in a child forked for it, as ``python -c`` would exit (an
# exception: its traceback and 1); a case still running after 120 s is killed (-9).
FORK_SERVER = """
import json, os, signal, sys, time
import torch.distributed.run  # what the entry points' parsers are built from
from tests.forked import exit_as_python

def run(case):
    pid = os.fork()
    if not pid:
        exit_as_python(lambda: exec(compile(case["code"], "<string>", "exec"),
                                    {"__name__": "__main__"}),
                       env=case["env"], cwd=case["cwd"], stdout=case["stdout"],
                       stderr=case["stderr"])
    deadline = time.monotonic() + 120
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
        time.sleep(0.02)

for line in sys.stdin:
    print(run(json.loads(line)), flush=True)
"""


@pytest.fixture(scope="module")
def fork_server() -> Iterator[subprocess.Popen[str]]:
    server = subprocess.Popen([sys.executable, "-c", FORK_SERVER], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True, cwd=ROOT)
    yield server
    server.stdin.close()  # the server ends after its case in progress, which ends within 120 s
    try:
        server.wait(timeout=150)
    finally:
        server.kill()
        server.wait()


def run_blocked(script: str, argv: list[str], block: tuple[str, ...], job_env, tmp_path,
                setup: str = "", server: subprocess.Popen[str] | None = None
                ) -> subprocess.CompletedProcess:
    """The entry point ``script`` run with ``argv`` and ``block`` hidden: in a child of
    ``server`` (:func:`fork_server`), or without one in a fresh interpreter."""
    code = RUNNER.format(block=block, setup=setup, argv=[script, *argv],
                         script=str(BIN / script))
    if server is None:
        return subprocess.run([sys.executable, "-c", code], env=job_env, cwd=tmp_path,
                              capture_output=True, text=True, timeout=120)
    out, err = tmp_path / "stdout", tmp_path / "stderr"
    server.stdin.write(json.dumps({"code": code, "env": job_env, "cwd": str(tmp_path),
                                   "stdout": str(out), "stderr": str(err)}) + "\n")
    server.stdin.flush()
    # The server answers within 120 s of a case's start (it kills one that runs longer), and
    # needs a moment more to import torch before its first.
    assert select.select([server.stdout], [], [], 240)[0], "the fork server did not answer"
    returncode = int(server.stdout.readline())
    return subprocess.CompletedProcess(code, returncode, out.read_text(), err.read_text())


def assert_one_line(done: subprocess.CompletedProcess, prog: str, package: str,
                    extra: str) -> None:
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2, done.stderr
    assert len(lines) == 1, done.stderr
    assert lines[0].startswith(f"{prog}: error: ")
    assert f"needs {package}: pip install 'elasticft[{extra}]'" in lines[0]


@pytest.mark.parametrize("prog", ["elasticft-run", "torchrun"])
@pytest.mark.parametrize("block, package", [(("grpc",), "grpcio"),
                                            (("pyetcd",), "etcd-sdk-python")])
def test_etcd_rendezvous_without_the_etcd_extra(prog, block, package, job_env, tmp_path,
                                                fork_server):
    job_env.pop("LOGLEVEL")  # torchrun's own INFO lines would come first
    # torchrun makes its log directory before it fails: here, not a new /tmp/torchelastic_*.
    done = run_blocked(prog, ["--log-dir", str(tmp_path / "logs"), *ETCD_ARGS], block, job_env,
                       tmp_path, server=fork_server)
    assert_one_line(done, prog, package, "etcd")


def test_elasticft_status_without_the_etcd_extra(job_env, tmp_path, fork_server):
    done = run_blocked("elasticft", ["status", "--rdzv-endpoint", "127.0.0.1:1",
                                     "--rdzv-id", "job"], ("grpc",), job_env, tmp_path,
                       server=fork_server)
    assert_one_line(done, "elasticft status", "grpcio", "etcd")


def test_report_plot_without_matplotlib(job_env, tmp_path, fork_server):
    (tmp_path / "run").mkdir()
    done = run_blocked("elasticft", ["report", str(tmp_path / "run"), "--plot",
                                     str(tmp_path / "t.png")], ("matplotlib",), job_env, tmp_path,
                       server=fork_server)
    assert_one_line(done, "elasticft report", "matplotlib", "report")


def test_hang_stacks_without_py_spy(job_env, tmp_path, fork_server):
    hide = "import elasticft.diag.stacks as s; s.py_spy_path = lambda: None"
    done = run_blocked("elasticft-run", ["--standalone", "--nproc-per-node", "1", str(WORKER)],
                       (), job_env, tmp_path, setup=hide, server=fork_server)
    assert_one_line(done, "elasticft-run", "py-spy", "diag")
    assert "--diag-enabled false" in done.stderr


def test_gpu_node_without_nvml(job_env, tmp_path):
    # In a fresh interpreter: importing torch, as the fork server does, imports pynvml.
    (tmp_path / "nvidia0").touch()  # this node's GPU, as far as the check can tell
    devices = str(tmp_path / "nvidia[0-9]*")
    fake_gpu = f"import elasticft.diag.health as h; h.GPU_DEVICE_GLOB = {devices!r}"
    done = run_blocked("elasticft-run", ["--standalone", "--nproc-per-node", "1", str(WORKER)],
                       ("pynvml",), job_env, tmp_path, setup=fake_gpu)
    assert_one_line(done, "elasticft-run", "nvidia-ml-py", "gpu")


def test_missing_extra_is_an_import_error_with_a_reason():
    error = MissingExtra("the plot", "matplotlib", "report", "or leave out --plot")
    assert isinstance(error, ImportError) and error.reason == "missing_extra"
    assert str(error) == ("the plot needs matplotlib: pip install 'elasticft[report]' "
                          "(or leave out --plot)")
