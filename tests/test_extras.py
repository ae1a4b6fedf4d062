"""A missing optional dependency ends every entry point with one line naming the extra to
install and exit code 2. Each case runs the real entry point in a subprocess in which the
package is made unimportable (``sys.modules[name] = None``, as Python does for a blocked import)
or the program unfindable."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from elasticft.extras import MissingExtra
from tests.conftest import BIN

WORKER = Path(__file__).parent / "agent" / "workers" / "sleep_forever.py"
ETCD_ARGS = ["--nnodes", "1", "--nproc-per-node", "1", "--rdzv-backend", "etcd-v3",
             "--rdzv-endpoint", "127.0.0.1:1", "--rdzv-id", "job", str(WORKER)]

# The entry point's main, called in a fresh interpreter after hiding ``BLOCK``.
RUNNER = """
import runpy, sys
for name in {block!r}:
    sys.modules[name] = None
{setup}
sys.argv = {argv!r}
runpy.run_path({script!r}, run_name="__main__")
"""


def run_blocked(script: str, argv: list[str], block: tuple[str, ...], job_env, tmp_path,
                setup: str = "") -> subprocess.CompletedProcess:
    code = RUNNER.format(block=block, setup=setup, argv=[script, *argv],
                         script=str(BIN / script))
    return subprocess.run([sys.executable, "-c", code], env=job_env, cwd=tmp_path,
                          capture_output=True, text=True, timeout=120)


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
def test_etcd_rendezvous_without_the_etcd_extra(prog, block, package, job_env, tmp_path):
    job_env.pop("LOGLEVEL")  # torchrun's own INFO lines would come first
    # torchrun makes its log directory before it fails: here, not a new /tmp/torchelastic_*.
    done = run_blocked(prog, ["--log-dir", str(tmp_path / "logs"), *ETCD_ARGS], block, job_env,
                       tmp_path)
    assert_one_line(done, prog, package, "etcd")


def test_elasticft_status_without_the_etcd_extra(job_env, tmp_path):
    done = run_blocked("elasticft", ["status", "--rdzv-endpoint", "127.0.0.1:1",
                                     "--rdzv-id", "job"], ("grpc",), job_env, tmp_path)
    assert_one_line(done, "elasticft status", "grpcio", "etcd")


def test_report_plot_without_matplotlib(job_env, tmp_path):
    (tmp_path / "run").mkdir()
    done = run_blocked("elasticft", ["report", str(tmp_path / "run"), "--plot",
                                     str(tmp_path / "t.png")], ("matplotlib",), job_env, tmp_path)
    assert_one_line(done, "elasticft report", "matplotlib", "report")


def test_hang_stacks_without_py_spy(job_env, tmp_path):
    hide = "import elasticft.diag.stacks as s; s.py_spy_path = lambda: None"
    done = run_blocked("elasticft-run", ["--standalone", "--nproc-per-node", "1", str(WORKER)],
                       (), job_env, tmp_path, setup=hide)
    assert_one_line(done, "elasticft-run", "py-spy", "diag")
    assert "--diag-enabled false" in done.stderr


def test_gpu_node_without_nvml(job_env, tmp_path):
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
