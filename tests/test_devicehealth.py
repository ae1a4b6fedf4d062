"""The device health checks' decisions by tables, with NVML's answers as data: which answers
make a GPU unfit, which device a rank uses and how NVML is told which GPU that is; NVML's
errors turned into answers; a check whose synchronize hangs or raises; the known answer."""

from __future__ import annotations

import threading
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from elasticft.devicehealth import (
    ArmedDevice,
    CudaCalls,
    NvmlAnswers,
    RankDevice,
    check_device,
    known_answer,
    nvml_problems,
    nvml_verdict,
    pci_bus_id_of,
    rank_device_index,
    read_nvml,
    uuid_of,
)

A = NvmlAnswers


@pytest.mark.parametrize(("answers", "baseline", "kinds"), [
    (A(), None, []),  # nothing answered (no NVML support)
    (A(False, False, False, 0, 0), None, []),
    # before Ampere: retired pages
    (A(retired_pages_pending=True), None, ["gpu_retired_pages"]),
    # Ampere and later: row remapping
    (A(remapped_rows_pending=True, remapping_failed=False), None, ["gpu_row_remap"]),
    (A(remapped_rows_pending=False, remapping_failed=True), None, ["gpu_row_remap"]),
    (A(remapped_rows_pending=True, remapping_failed=True), None,
     ["gpu_row_remap", "gpu_row_remap"]),
    # the driver's recovery action: none, a reset, a reboot, one this table does not name
    (A(recovery_action=0), None, []),
    (A(recovery_action=1), None, ["gpu_recovery_action"]),
    (A(recovery_action=2), None, ["gpu_recovery_action"]),
    (A(recovery_action=99), None, ["gpu_recovery_action"]),
    # uncorrectable ECC: since the driver loaded without a baseline, since it with one
    (A(uncorrectable_ecc=2), None, ["gpu_ecc"]),
    (A(uncorrectable_ecc=2), A(uncorrectable_ecc=2), []),
    (A(uncorrectable_ecc=3), A(uncorrectable_ecc=2), ["gpu_ecc"]),
    (A(uncorrectable_ecc=2), A(), ["gpu_ecc"]),  # the baseline had no answer
    (A(uncorrectable_ecc=None), A(uncorrectable_ecc=2), []),  # no answer now
    # NVML failed a question it should answer (the GPU lost)
    (A(error="ECC errors: GPU is lost"), None, ["gpu_nvml"]),
    (A(retired_pages_pending=True, uncorrectable_ecc=1, recovery_action=1), None,
     ["gpu_recovery_action", "gpu_retired_pages", "gpu_ecc"]),
])
def test_which_nvml_answers_make_a_gpu_unfit(answers: NvmlAnswers, baseline: NvmlAnswers | None,
                                             kinds: list[str]) -> None:
    assert [kind for kind, _ in nvml_problems(answers, baseline)] == kinds
    verdict = nvml_verdict(answers, baseline)
    assert (verdict is None) == (not kinds)


@pytest.mark.parametrize(("answers", "baseline", "said"), [
    (A(uncorrectable_ecc=5), A(uncorrectable_ecc=3),
     "2 uncorrectable ECC error(s) since the job started (5 since the driver loaded)"),
    (A(uncorrectable_ecc=1), None, "1 uncorrectable ECC error(s) since the driver loaded"),
    (A(recovery_action=4), None, "the driver asks for a drain and a GPU reset (NVML recovery "
     "action 4)"),
    (A(remapping_failed=True), None, "a memory row could not be remapped (the GPU has no spare "
     "row left)"),
])
def test_an_unfit_gpu_is_told_why(answers: NvmlAnswers, baseline: NvmlAnswers | None,
                                  said: str) -> None:
    assert nvml_verdict(answers, baseline) == said


@pytest.mark.parametrize(("bound", "cuda_in_use", "current", "expected"), [
    (torch.device("cuda", 3), True, 0, 3),  # the group's bound device wins
    (torch.device("cuda", 3), False, 0, 3),
    (torch.device("cuda"), True, 2, 2),  # bound without an index: the current one
    (None, True, 1, 1),  # no bound device: the main thread's current device
    (torch.device("cpu"), True, 1, 1),
    (None, False, 0, None),  # no CUDA in use: no device to check
    (torch.device("cpu"), False, 0, None),
])
def test_which_device_a_rank_uses(bound: torch.device | None, cuda_in_use: bool, current: int,
                                  expected: int | None) -> None:
    assert rank_device_index(bound, cuda_in_use, lambda: current) == expected


ARMED_ON_1 = ArmedDevice(RankDevice(1, "00000000:3B:00.0"), NvmlAnswers(uncorrectable_ecc=2))


@pytest.mark.timeout(60)
@pytest.mark.parametrize(("armed", "bound", "now", "expected"), [
    # CUDA not in use when recovery armed (the model went to its GPU inside the function):
    # the failure finds the rank's device, with no NVML baseline
    (ArmedDevice(), None, RankDevice(3), ArmedDevice(RankDevice(3), None)),
    # the script set its device after arming: the device it uses now
    (ARMED_ON_1, None, RankDevice(2), ArmedDevice(RankDevice(2), None)),
    (ARMED_ON_1, None, RankDevice(1), ARMED_ON_1),  # the same device keeps its baseline
    (ARMED_ON_1, None, None, ARMED_ON_1),  # CUDA not initialised now: the armed one
    (ArmedDevice(), None, None, ArmedDevice()),  # gloo on CPU
    # a group bound to its device (NCCL's device_id) names it for good
    (ARMED_ON_1, torch.device("cuda", 1), RankDevice(0), ARMED_ON_1),
])
def test_the_ranks_device_is_the_one_the_failure_finds(
        armed: ArmedDevice, bound: torch.device | None, now: RankDevice | None,
        expected: ArmedDevice) -> None:
    assert armed.at_failure(bound, capture=lambda _bound: now) == expected


@pytest.mark.parametrize(("properties", "bus_id", "uuid"), [
    (SimpleNamespace(pci_domain_id=0, pci_bus_id=0x3B, pci_device_id=0,
                     uuid="6f1e4a52-09f4-2b8c-1d2e-3f4a5b6c7d8e"),
     "00000000:3B:00.0", "GPU-6f1e4a52-09f4-2b8c-1d2e-3f4a5b6c7d8e"),
    (SimpleNamespace(pci_domain_id=1, pci_bus_id=0xC1, pci_device_id=2, uuid="GPU-abc"),
     "00000001:C1:02.0", "GPU-abc"),
    (SimpleNamespace(uuid="MIG-abc"), None, "MIG-abc"),  # an older torch: no PCI fields
    (SimpleNamespace(), None, None),
])
def test_the_gpu_is_named_to_nvml_by_pci_bus_id_or_uuid(properties: Any, bus_id: str | None,
                                                       uuid: str | None) -> None:
    assert pci_bus_id_of(properties) == bus_id
    assert uuid_of(properties) == uuid


class NVMLError(Exception):
    def __init__(self, value: int) -> None:
        super().__init__({3: "Not Supported", 15: "GPU is lost"}[value])
        self.value = value


def fake_nvml(**answers: Any) -> SimpleNamespace:
    """pynvml's few calls the reader makes; an int answer that is an NVML error code raises."""

    def answer(name: str) -> Any:
        def call(*_: Any) -> Any:
            value = answers[name]
            if isinstance(value, NVMLError):
                raise value
            return value
        return call

    field = answers.get("field", (0, 0))
    return SimpleNamespace(
        NVML_ERROR_NOT_SUPPORTED=3, NVML_MEMORY_ERROR_TYPE_UNCORRECTED=1, NVML_VOLATILE_ECC=0,
        nvmlDeviceGetRetiredPagesPendingStatus=answer("pages"),
        nvmlDeviceGetRemappedRows=answer("rows"),
        nvmlDeviceGetTotalEccErrors=answer("ecc"),
        nvmlDeviceGetFieldValues=lambda handle, ids: [SimpleNamespace(
            nvmlReturn=field[0], value=SimpleNamespace(uiVal=field[1]))])


@pytest.mark.parametrize(("nvml", "expected"), [
    (fake_nvml(pages=0, rows=(0, 0, 0, 0), ecc=0), A(False, False, False, 0, 0)),
    # an H100: no retired pages, a pending remap, a reset asked for
    (fake_nvml(pages=NVMLError(3), rows=(0, 1, 1, 0), ecc=1, field=(0, 1)),
     A(None, True, False, 1, 1)),
    # a V100: no row remapping, no recovery action field
    (fake_nvml(pages=1, rows=NVMLError(3), ecc=0, field=(3, 0)), A(True, None, None, None, 0)),
    # the GPU lost: its error is kept
    (fake_nvml(pages=NVMLError(15), rows=(0, 0, 0, 0), ecc=0),
     A(None, False, False, 0, 0, error="retired pages: GPU is lost")),
])
def test_nvml_is_read_into_plain_answers(nvml: SimpleNamespace, expected: NvmlAnswers) -> None:
    assert read_nvml(nvml, handle=object()) == expected


def test_a_check_whose_synchronize_hangs_or_raises_fails_on_the_ranks_device() -> None:
    never = threading.Event()
    hung = CudaCalls(lambda index: None, lambda: 1, lambda index: never.wait())
    verdict = check_device(RankDevice(1), 0.2, cuda=hung, nvml=lambda device: None)
    never.set()
    assert not verdict.ok
    assert verdict.detail == "torch.cuda.synchronize() of GPU 1 did not come within 0.2 s"
    fine = CudaCalls(lambda index: None, lambda: 1, lambda index: None)
    stuck = threading.Event()  # an NVML that never answers is bounded by the same limit
    verdict = check_device(RankDevice(1), 0.2, cuda=fine, nvml=lambda device: stuck.wait())
    stuck.set()
    assert verdict.detail == "NVML's answer for GPU 1 did not come within 0.2 s"

    def illegal(index: int) -> None:
        raise RuntimeError("CUDA error: an illegal memory access was encountered\nmore")

    verdict = check_device(RankDevice(1), 5.0, cuda=CudaCalls(lambda i: None, lambda: 1, illegal),
                           nvml=lambda device: A(retired_pages_pending=True))
    assert not verdict.ok
    assert verdict.detail == ("GPU 1: RuntimeError: CUDA error: an illegal memory access was "
                              "encountered")
    asked: list[RankDevice] = []
    verdict = check_device(RankDevice(1, uuid="GPU-x"), 5.0,
                           cuda=CudaCalls(lambda i: None, lambda: 1, lambda i: None),
                           nvml=lambda device: asked.append(device) or A(recovery_action=2))
    assert not verdict.ok and asked == [RankDevice(1, uuid="GPU-x")]
    assert verdict.detail == "NVML: GPU 1: the driver asks for a node reboot (NVML recovery " \
                             "action 2)"


def test_the_known_answer_is_right_on_this_cpu() -> None:
    verdict = known_answer()
    assert verdict.ok and verdict.evidence["wrong_entries"] == 0
