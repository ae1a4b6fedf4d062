"""Shared test fixtures: paths, a clean environment for launched jobs, free ports, and the
uninterrupted reference runs the recovery and in-process tests compare losses with."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import psutil
import pytest
from filelock import FileLock

# One intra-op thread in every process of the suite (pytest's own, and through the environment
# every job, agent and worker it launches), as torchrun gives several workers of one node. The
# suite's "nodes" share this machine's cores: a worker alone on its agent keeps torch's default
# of a thread per core, and its spinning threads took the cores the other nodes' workers waited
# for (a two-node Slurm job's workers spent 24 s of CPU on 160 steps of a tiny model, against
# 1.5 s with one thread). Set before any test module imports torch. A test of what a user's
# shell gives takes it out of its job's environment (test_demo.py).
os.environ.setdefault("OMP_NUM_THREADS", "1")

from tests.servers import EtcdServer, echo_server, etcd_cluster, etcd_server  # noqa: F401

if TYPE_CHECKING:
    from tests.cluster import Losses

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples"
BIN = Path(sys.executable).parent
TEST_NCCL_DIR = os.environ.get("ELASTICFT_TEST_NCCL_DIR")
"""Another ``libnccl.so.2`` for the shim's tests; read here, before any test runs, because
:func:`no_elasticft_variables_from_the_shell` hides it from the tests themselves."""


@pytest.fixture(autouse=True)
def no_elasticft_variables_from_the_shell(monkeypatch: pytest.MonkeyPatch) -> None:
    """No test sees an ``ELASTICFT_*`` variable of the shell that started pytest.

    elasticft-run obeys the ones it knows and refuses the ones it does not, so a developer's
    exported option, or a test-script knob such as ``ELASTICFT_COMPAT_TORCH``, would change or
    fail what an in-process test checks. Tests set the variables they mean themselves.
    """
    for name in [n for n in os.environ if n.startswith("ELASTICFT_")]:
        monkeypatch.delenv(name)


def pytest_ignore_collect(collection_path: Path, config: pytest.Config) -> bool | None:
    """In the ``serial`` phase, a test file that never writes ``pytest.mark.serial`` is not
    imported at all: the phase runs a dozen tests, and collecting the other files (torch's
    distributed packages, DCP, every parametrization) would take it longer than they do."""
    if (os.environ.get("TEST_PHASE") == "serial" and collection_path.suffix == ".py"
            and collection_path.name.startswith("test_")
            and "pytest.mark.serial" not in collection_path.read_text()):
        return True
    return None  # pytest's own rules (--ignore, collect_ignore) decide


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Tests marked ``gpu`` run where CUDA is; elsewhere they show as skipped, with the reason.

    ``TEST_PHASE`` (set by scripts/test.sh) splits a run in two: ``parallel`` leaves out the
    tests marked ``serial``, ``serial`` keeps only them (a file's tests are marked in the file
    itself, see :func:`pytest_ignore_collect`); unset, every test runs. Whole files
    are then ordered longest first (:func:`longest_files_first`).
    """
    phase = os.environ.get("TEST_PHASE")
    if phase in ("parallel", "serial"):
        wanted = phase == "serial"
        config.hook.pytest_deselected(
            items=[item for item in items if ("serial" in item.keywords) != wanted])
        items[:] = [item for item in items if ("serial" in item.keywords) == wanted]
    longest_files_first(items, float(config.getini("timeout") or 0))
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device (bench/gpu_check.sh runs them there)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def longest_files_first(items: list[pytest.Item], default_timeout: float) -> None:
    """Orders whole test files by the time their slow tests are allowed (the sum of their
    timeouts, a rough measure of how long they take), longest first; the tests of a file keep
    their order and stay together.

    pytest-xdist's ``--dist loadfile`` hands files to its workers in this order when it does
    not reorder them itself (scripts/test.sh passes ``--no-loadscope-reorder``; by default it
    puts the files with the most tests first, which leaves the one-test multi-process files
    of a minute each for the end, one worker running them while the other has nothing left).
    Long files first, the unit-test files fill the end.
    """
    budget: dict[Path, float] = {}
    first: dict[Path, int] = {}
    for index, item in enumerate(items):
        first.setdefault(item.path, index)
        if "slow" in item.keywords and "gpu" not in item.keywords:
            marker = item.get_closest_marker("timeout")
            allowed = marker.kwargs.get("timeout", marker.args[0] if marker.args else None) \
                if marker is not None else None
            budget[item.path] = budget.get(item.path, 0.0) + float(allowed or default_timeout)
    items.sort(key=lambda item: (-budget.get(item.path, 0.0), first[item.path]))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def pids_by_rank(path: Path) -> dict[int, list[int]]:
    """The processes each rank trained in (an example's ``--pid-log``: rank, pid, step per line),
    oldest first."""
    found: dict[int, list[int]] = {}
    for line in path.read_text().split("\n")[:-1]:  # the last one may be still being written
        rank, pid, _ = (int(v) for v in line.split())
        if pid not in found.setdefault(rank, []):
            found[rank].append(pid)
    return found


def clean_job_env() -> dict[str, str]:
    """The environment a launched job gets: this one, minus variables that would steer it (a
    suite run inside a Kubernetes pod must not make every SIGTERM a preemption notice)."""
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("ELASTICFT_", "PET_", "TORCHELASTIC_", "SLURM_", "KUBERNETES_"))
        and k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
    }
    env["PYTHONUNBUFFERED"] = "1"
    env["LOGLEVEL"] = "INFO"
    return env


@pytest.fixture
def job_env() -> dict[str, str]:
    """The environment a launched job gets (:func:`clean_job_env`)."""
    return clean_job_env()


def python_stacks(pid: int) -> str:
    """The Python stacks of a process and its children (py-spy), for a test's failure."""
    stacks = []
    for process in [psutil.Process(pid), *psutil.Process(pid).children(True)]:
        with contextlib.suppress(psutil.NoSuchProcess):
            dump = subprocess.run([str(BIN / "py-spy"), "dump", "--pid", str(process.pid)],
                                  capture_output=True, text=True, timeout=30)
            stacks.append(f"--- pid {process.pid} {process.cmdline()[:3]}\n"
                          f"{dump.stdout}{dump.stderr}")
    return "\n".join(stacks)


def communicate_or_explain(proc: subprocess.Popen, timeout: float) -> tuple[str, str]:
    """``proc.communicate(timeout)``; when it times out, the failure shows why the process hung:
    the Python stacks of it and its children (py-spy) and the end of its stderr."""
    try:
        return proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        stacks = python_stacks(proc.pid)
        os.killpg(proc.pid, signal.SIGKILL)
        _, stderr = proc.communicate()
        raise AssertionError(
            f"{proc.args[:2]} still running after {timeout} s\n" + stacks
            + f"\n--- stderr (end)\n{stderr[-6000:]}"
        ) from None


def wait_or_explain(proc: subprocess.Popen, timeout: float, output: Callable[[], str]) -> int:
    """``proc.wait(timeout)``; when it times out, the failure shows the Python stacks of it and
    its children and ``output()`` (the logs the process writes elsewhere)."""
    try:
        return proc.wait(timeout)
    except subprocess.TimeoutExpired:
        raise AssertionError(f"{proc.args[:2]} still running after {timeout} s\n"
                             + python_stacks(proc.pid) + "\n" + output()) from None


def made_once(tmp_path_factory: pytest.TempPathFactory, name: str, make: Callable[[], Any]
              ) -> Any:
    """``make()``'s result (JSON), made once per test run: pytest-xdist's workers share it
    through a file in the run's common temporary directory; the first to need it makes it,
    under a lock, and the others read it."""
    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent  # the run's, above each worker's own
    path = root / f"{name}.json"
    with FileLock(f"{path}.lock"):
        if not path.exists():
            path.write_text(json.dumps(make()))
    return json.loads(path.read_text())


@pytest.fixture(scope="session")
def reference(tmp_path_factory: pytest.TempPathFactory) -> dict[tuple[Path, int], Losses]:
    """Uninterrupted runs of the node-fault tests, one per example script, each made once per
    test run (:func:`made_once`); ``reference[script, steps]`` is an uninterrupted
    ``steps``-step run's losses.

    A step's loss does not depend on ``--steps`` (no schedule looks at the total), so the
    first N steps of one LONG-step run are the losses of an uninterrupted N-step run: one
    reference run per script serves every run length up to LONG."""
    from tests.cluster import Losses, reference_losses
    from tests.recovery.test_faults import LONG

    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("ELASTICFT_", "PET_", "TORCHELASTIC_", "SLURM_"))}
    env["PYTHONUNBUFFERED"] = "1"
    full: dict[Path, Losses] = {}

    def run(script: Path) -> dict[str, dict[int, Any]]:
        losses = reference_losses(tmp_path_factory.mktemp(script.stem), env, script, LONG)
        return {"values": losses.values, "logged": losses.logged}

    class Lazy(dict):
        def __missing__(self, key: tuple[Path, int]) -> Losses:
            script, steps = key
            assert steps <= LONG, f"reference runs have {LONG} steps, not {steps}"
            if script not in full:
                made = made_once(tmp_path_factory, f"reference-{script.stem}",
                                 lambda: run(script))
                full[script] = Losses({int(s): v for s, v in made["values"].items()},
                                      {int(s): n for s, n in made["logged"].items()})
            whole = full[script]
            self[key] = Losses({s: v for s, v in whole.values.items() if s <= steps},
                               {s: n for s, n in whole.logged.items() if s <= steps})
            return self[key]

    return Lazy()
