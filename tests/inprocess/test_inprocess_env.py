"""What in-process recovery asks of NCCL and of the device, by tables (pure parts), the
bounded call the teardown and the health check run under, and the monitor that frees a
survivor's main thread."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest

from elasticft.devicehealth import ArmedDevice, CudaCalls, NvmlAnswers, RankDevice
from elasticft.inprocess.device import within
from elasticft.inprocess.interrupt import Monitor, PeerInterrupted
from elasticft.inprocess.ncclenv import abort_warning, missing, script_arms, worker_env
from elasticft.inprocess.protocol import INTERRUPT_FILE
from elasticft.inprocess.reconfigure import REGIME_ENV
from elasticft.jsonfile import read_json, write_json

IN_PROCESS_NCCL = {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "0", "TORCH_NCCL_RETHROW_CUDA_ERRORS": "0",
                   "NCCL_NVLS_ENABLE": "0", "TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC": "480",
                   "TORCH_NCCL_WAIT_TIMEOUT_DUMP_MILSEC": "250"}


@pytest.mark.timeout(30)
@pytest.mark.parametrize(("environ", "limit", "gpus", "in_process", "expected"), [
    # the watchdog handles nothing: elasticft's abort is the only one (torch's documentation of
    # _abort_process_group asks for it), and its dump wait does not hold a survivor a minute
    ({}, 30.0, True, True, IN_PROCESS_NCCL),
    ({}, 200.0, True, True, {**IN_PROCESS_NCCL, "TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC": "860"}),
    # what the user set stays theirs
    ({"TORCH_NCCL_ASYNC_ERROR_HANDLING": "1", "NCCL_NVLS_ENABLE": "1",
      "TORCH_NCCL_WAIT_TIMEOUT_DUMP_MILSEC": "15000"}, 30.0, True, True,
     {"TORCH_NCCL_RETHROW_CUDA_ERRORS": "0", "TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC": "480"}),
    # a job that never armed InProcess keeps NVLink SHARP and torch's own error handling
    ({}, 30.0, True, False, {}),
    # a node without GPUs runs no NCCL
    ({}, 30.0, False, True, {}),
    ({}, 30.0, False, False, {}),
])
def test_the_workers_nccl_environment(environ: dict, limit: float, gpus: bool,
                                      in_process: bool, expected: dict) -> None:
    assert worker_env(environ, limit, gpus=gpus, in_process=in_process) == expected


@pytest.mark.timeout(30)
@pytest.mark.parametrize(("environ", "lacking"), [
    (IN_PROCESS_NCCL, []),
    ({}, ["TORCH_NCCL_ASYNC_ERROR_HANDLING=0", "TORCH_NCCL_WAIT_TIMEOUT_DUMP_MILSEC=250"]),
    ({"TORCH_NCCL_ASYNC_ERROR_HANDLING": "1", "TORCH_NCCL_WAIT_TIMEOUT_DUMP_MILSEC": "100"},
     ["TORCH_NCCL_ASYNC_ERROR_HANDLING=0"]),  # torchrun's 1: a job's first start
])
def test_a_survivor_names_the_nccl_settings_it_started_without(environ: dict,
                                                                lacking: list) -> None:
    assert missing(environ) == lacking


@pytest.mark.timeout(30)
@pytest.mark.parametrize(("version", "warns"), [
    (None, False), ((2, 21, 5), False), ((2, 28, 2), False), ((2, 28, 3), True),
    ((2, 28, 8), True), ((2, 28, 9), False), ((2, 29, 1), False), ((2, 28), False),
])
def test_nccl_versions_whose_abort_is_broken_are_named(version: tuple | None,
                                                      warns: bool) -> None:
    warning = abort_warning(version)
    assert (warning is not None) is warns
    if warns:
        assert "2.28.3-2.28.8" in warning and "2.28.9" in warning


@pytest.mark.timeout(30)
def test_a_bounded_call_returns_its_error_or_gives_up_at_the_limit() -> None:
    assert within(lambda: None, 5.0) == (True, None)
    finished, error = within(lambda: 1 / 0, 5.0)
    assert finished and isinstance(error, ZeroDivisionError)
    never = threading.Event()
    assert within(never.wait, 0.2) == (False, None)  # a call that never returns
    never.set()


class PerThreadDevice:
    """CUDA's current device as torch keeps it: per thread, device 0 in a new thread. It stands
    in for ``torch.cuda.set_device``/``current_device``/``synchronize`` where no GPU is; what
    each thread synchronized is recorded as (thread, its current device, the device asked)."""

    def __init__(self) -> None:
        self._local = threading.local()
        self.synchronized: list[tuple[str, int, int]] = []

    def set_device(self, index: int) -> None:
        self._local.index = index

    def current_device(self) -> int:
        return getattr(self._local, "index", 0)

    def synchronize(self, index: int) -> None:
        self.synchronized.append((threading.current_thread().name, self.current_device(), index))

    def calls(self) -> CudaCalls:
        return CudaCalls(self.set_device, self.current_device, self.synchronize)


@pytest.mark.timeout(30)
def test_the_bounded_call_runs_on_the_ranks_device_not_device_0() -> None:
    cuda = PerThreadDevice()
    cuda.set_device(3)  # the main thread's, as the script set it
    seen: list[int] = []
    assert within(lambda: seen.append(cuda.current_device()), 5.0, cuda=cuda.calls()) == (
        True, None)
    assert seen == [0]  # a bare helper thread is on device 0: what the check must not use
    assert within(lambda: seen.append(cuda.current_device()), 5.0, 3, cuda.calls()) == (
        True, None)
    assert seen == [0, 3] and cuda.current_device() == 3


@pytest.mark.timeout(30)
def test_the_rejoin_check_synchronizes_the_armed_device_from_its_helper_thread() -> None:
    """The survivor's check (:meth:`ArmedDevice.check`, what ``device_health`` runs) on rank
    device 2 with NVML's baseline taken when it armed: the CUDA branch, with the per-thread
    device calls above in place of torch's."""
    cuda = PerThreadDevice()
    armed = ArmedDevice(RankDevice(2, "00000000:3B:00.0"), NvmlAnswers(uncorrectable_ecc=4))
    verdict = armed.check(5.0, cuda.calls(), lambda device: NvmlAnswers(uncorrectable_ecc=4))
    assert verdict.ok, verdict.detail
    assert cuda.synchronized == [("elasticft-bounded", 2, 2)]
    assert verdict.evidence["thread_device"] == 2
    verdict = armed.check(5.0, cuda.calls(), lambda device: NvmlAnswers(uncorrectable_ecc=5))
    assert not verdict.ok
    assert verdict.detail == ("NVML: GPU 2 (00000000:3B:00.0): 1 uncorrectable ECC error(s) "
                              "since the job started (5 since the driver loaded)")


@pytest.mark.timeout(60)
def test_the_monitor_ends_the_groups_and_frees_a_busy_main_thread(tmp_path: Path) -> None:
    """The agent's notice: the monitor calls ``end`` once, then raises ``PeerInterrupted`` into
    the main thread, which here runs Python code and would never leave by itself."""
    ended: list[float] = []
    monitor = Monitor(tmp_path, read_json, lambda: ended.append(time.time()) or "test",
                      grace_s=0.05)
    monitor.start()
    write_json(tmp_path / INTERRUPT_FILE, {"ended": 0})
    time.sleep(0.1)
    assert not ended  # outside the training function nothing is ended or raised
    monitor.entering(0)
    with pytest.raises(PeerInterrupted):
        while True:  # a busy loop: only the asynchronous exception ends it
            pass
    assert monitor.left(5.0)
    assert len(ended) == 1 and monitor.interrupted and monitor.how == "test"
    monitor.entering(1)  # generation 1: the notice for 0 no longer applies
    time.sleep(0.2)
    assert len(ended) == 1 and not monitor.interrupted
    monitor.stop()


@pytest.mark.timeout(60)
@pytest.mark.parametrize(("in_use", "script", "given"), [
    (True, "import torch\n", True),
    (False, "import torch\n", False),
    (False, "from elasticft.inprocess import InProcess\n", True),
    (False, "from elasticft.integrations.lightning import InProcessDDPStrategy\n", True),
    (False, None, False),  # no script to read (python -m module)
], ids=["armed", "plain-script", "script-imports-inprocess", "script-imports-integration",
        "no-script"])
def test_an_agent_on_a_gpu_node_gives_the_nccl_settings_only_to_a_job_under_inprocess(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path, in_use: bool, script: str | None,
        given: bool) -> None:
    """``startup_env`` of a job whose workers never armed ``InProcess`` and whose script does
    not name it is empty, on a node with GPUs too; a script that names it gets them from its
    first start, and once the workers armed (``InProcessRecovery.in_use``) every later start
    does."""
    from elasticft.agent import agent as agent_module

    monkeypatch.setattr(agent_module, "gpu_devices_present", lambda: True)
    for name in IN_PROCESS_NCCL:
        monkeypatch.delenv(name, raising=False)
    args: tuple[str, ...] = ("-m", "train")
    if script is not None:
        (tmp_path / "train.py").write_text(script)
        args = ("-u", str(tmp_path / "train.py"), "--steps", "3")
    found = agent_module.ElasticftAgent.startup_env(_agent(in_use, args))  # type: ignore[arg-type]
    # The reconfigure regime from the script alone: the same for every start of the job.
    regime = {REGIME_ENV: "1"} if script is not None and script_arms(script) else {}
    assert found == ({**IN_PROCESS_NCCL, **regime} if given else {})


def _agent(in_use: bool, args: tuple[str, ...], regroup: str = "auto") -> object:
    """What ``startup_env`` reads of an agent."""
    from types import SimpleNamespace

    return SimpleNamespace(
        in_process=SimpleNamespace(in_use=in_use, teardown_limit_s=30.0),
        options=SimpleNamespace(recovery=SimpleNamespace(recovery_inprocess_regroup=regroup)),
        _worker_group=SimpleNamespace(spec=SimpleNamespace(args=args)))


@pytest.mark.timeout(30)
def test_a_job_told_to_make_new_groups_is_not_put_in_the_reconfigure_regime(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """``--recovery-inprocess-regroup new-group``: a script under ``InProcess`` gets the NCCL
    settings and no regime, on any torch."""
    from elasticft.agent import agent as agent_module

    monkeypatch.setattr(agent_module, "gpu_devices_present", lambda: True)
    for name in IN_PROCESS_NCCL:
        monkeypatch.delenv(name, raising=False)
    (tmp_path / "train.py").write_text("from elasticft.inprocess import InProcess\n")
    args = (str(tmp_path / "train.py"),)
    found = agent_module.ElasticftAgent.startup_env(
        _agent(False, args, "new-group"))  # type: ignore[arg-type]
    assert found == IN_PROCESS_NCCL
