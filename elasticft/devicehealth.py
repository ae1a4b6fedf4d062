"""Whether a device computes correctly and its driver vouches for it: one check, one verdict.

Four places ask whether a machine's hardware is fit: the pre-flight and periodic node checks
(:mod:`elasticft.diag.health`), a node's admission to the rendezvous
(:mod:`elasticft.rendezvous.health`), the node health that settles a split between two replicas
(:mod:`elasticft.ckpt.integrity.nodehealth`) and a survivor's rejoin after an in-process
recovery (:mod:`elasticft.inprocess.device`). Each asks the same few questions, answered here
once, each as a :class:`HealthVerdict` (fit or not, why, and the evidence for the event log):

* **a known answer** (:func:`known_answer`): a float64 matmul whose exact result is known, on
  the CPU or on a GPU. A wrong result is the one sign of a unit that computes wrong silently.
* **the rank's device** (:class:`RankDevice`, :func:`check_device`): a synchronize of the GPU a
  rank uses, under a time limit, from a helper thread (:func:`within`), so a device that hangs
  cannot hang the caller. CUDA's current device is per thread and a new thread's is device 0,
  so the helper thread first makes the rank's device its own (``torch.cuda.set_device``); a
  synchronize from a bare thread would wait on GPU 0, and make a context there, instead.
  Which device a rank uses is taken when the caller arms: the group's bound ``device_id``,
  else the caller's current device (:func:`rank_device_index`, a pure choice).
* **NVML's view of that GPU**: NVML numbers GPUs its own way (``CUDA_VISIBLE_DEVICES`` renumbers
  CUDA's), so the GPU is named to NVML by its PCI bus id, else its UUID, both read from CUDA.
  :func:`read_nvml` turns NVML into plain :class:`NvmlAnswers` (None: not supported or not
  known); :func:`nvml_problems` decides from them, and a baseline taken when the caller armed:
  retired pages pending (GPUs before Ampere), row remapping pending or failed (Ampere and
  later), the recovery action the driver asks for where it has one, and uncorrectable ECC
  errors (those since the baseline; since the driver loaded when there is none).

A process that uses no CUDA device passes the device check at once; without ``pynvml`` (the
``nvidia-ml-py`` package) or a driver, NVML gives no answer and the check rests on the rest.
torch is imported only when a check runs: the modules that import this one stay light.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
import time
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch


@dataclasses.dataclass(frozen=True)
class HealthVerdict:
    """One health check's outcome: fit or not, why, and what it was decided on."""

    ok: bool
    detail: str
    """Why the device is unfit when not ``ok``; what passed when ``ok``."""
    seconds: float = 0.0
    """How long the check took."""
    evidence: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    """What the verdict rests on (JSON-able), for the event log."""

    def to_json(self) -> dict[str, Any]:
        return {"ok": self.ok, "detail": self.detail, "seconds": round(self.seconds, 4),
                "evidence": dict(self.evidence)}


# -- a known answer -----------------------------------------------------------------------------

KNOWN_ANSWER_SIZE = 64
"""The matmul's side: milliseconds on a CPU, exact in float64 (its entries are small integers)."""


def known_answer(device: torch.device | str = "cpu", size: int = KNOWN_ANSWER_SIZE
                 ) -> HealthVerdict:
    """A float64 matmul with an exact known result on ``device``: right, or wrong and how."""
    import torch

    started = time.monotonic()
    a = (torch.arange(size * size, dtype=torch.float64, device=device).reshape(size, size)
         % 17)
    b = torch.eye(size, dtype=torch.float64, device=device) * 3
    wrong = int((a @ b != a * 3).sum().item())
    seconds = time.monotonic() - started
    evidence = {"device": str(device), "size": size, "wrong_entries": wrong}
    if wrong:
        return HealthVerdict(False, f"a float64 matmul with a known exact result came out wrong "
                             f"on {device} ({wrong} of {size * size} entries)", seconds, evidence)
    return HealthVerdict(True, f"a known-answer matmul on {device} is right", seconds, evidence)


# -- the rank's device and the helper thread ----------------------------------------------------

@dataclasses.dataclass(frozen=True)
class RankDevice:
    """The CUDA device a rank uses, by its index in this process and by names NVML knows."""

    index: int
    """CUDA's index in this process (after ``CUDA_VISIBLE_DEVICES``)."""
    pci_bus_id: str | None = None
    """NVML's form, ``"00000000:3B:00.0"``; None when CUDA does not say."""
    uuid: str | None = None
    """NVML's form, ``"GPU-..."``; None when CUDA does not say."""

    def describe(self) -> str:
        return f"GPU {self.index}" + (f" ({self.pci_bus_id})" if self.pci_bus_id else "")


def rank_device_index(bound: torch.device | None, cuda_in_use: bool,
                      current: Callable[[], int]) -> int | None:
    """The CUDA index of the device a rank uses, or None when it uses none.

    ``bound``: the group's ``device_id`` (NCCL's eager init names the rank's device); else,
    where CUDA is in use, the caller's current device (``current``), read on the caller's
    thread, which is the one the script set its device on.
    """
    if bound is not None and bound.type == "cuda":
        return bound.index if bound.index is not None else current()
    return current() if cuda_in_use else None


def pci_bus_id_of(properties: Any) -> str | None:
    """NVML's PCI bus id of a device, from CUDA's device properties (None if absent)."""
    try:
        domain, bus, device = (int(properties.pci_domain_id), int(properties.pci_bus_id),
                               int(properties.pci_device_id))
    except (AttributeError, TypeError, ValueError):
        return None
    return f"{domain:08X}:{bus:02X}:{device:02X}.0"


def uuid_of(properties: Any) -> str | None:
    """NVML's UUID of a device (``GPU-...``) from CUDA's device properties (None if absent)."""
    raw = str(getattr(properties, "uuid", "") or "")
    if not raw:
        return None
    return raw if raw.startswith(("GPU-", "MIG-")) else f"GPU-{raw}"


def capture_rank_device(bound: torch.device | None) -> RankDevice | None:
    """The rank's device, taken on the caller's thread when it arms (see the module)."""
    import torch

    cuda_in_use = torch.cuda.is_available() and torch.cuda.is_initialized()
    index = rank_device_index(bound, cuda_in_use, torch.cuda.current_device)
    if index is None:
        return None
    try:
        properties = torch.cuda.get_device_properties(index)
    except Exception:  # CUDA cannot describe it: the device is still checked, NVML not asked
        return RankDevice(index)
    return RankDevice(index, pci_bus_id_of(properties), uuid_of(properties))


@dataclasses.dataclass(frozen=True)
class CudaCalls:
    """The CUDA calls a helper thread makes: torch's (:meth:`of_torch`), replaceable to see
    what a thread did."""

    set_device: Callable[[int], None]
    current_device: Callable[[], int]
    synchronize: Callable[[int], None]

    @classmethod
    def of_torch(cls) -> CudaCalls:
        import torch

        return cls(torch.cuda.set_device, torch.cuda.current_device, torch.cuda.synchronize)


def within(call: Callable[[], Any], limit_s: float, device: int | None = None,
           cuda: CudaCalls | None = None) -> tuple[bool, BaseException | None]:
    """Runs ``call`` in a daemon thread for at most ``limit_s``: (finished, its error).

    With ``device``, the thread first makes that CUDA device its current one: a new thread's
    is device 0, whatever its caller's is. ``cuda``: torch's calls unless given.
    """
    outcome: list[BaseException | None] = []
    calls = cuda if cuda is not None or device is None else CudaCalls.of_torch()

    def run() -> None:
        try:
            if device is not None and calls is not None:
                calls.set_device(device)
            call()
            outcome.append(None)
        except BaseException as e:  # reported to the caller, whatever it was
            outcome.append(e)

    thread = threading.Thread(target=run, name="elasticft-bounded", daemon=True)
    thread.start()
    thread.join(limit_s)
    return (bool(outcome), outcome[0] if outcome else None)


# -- NVML ---------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class NvmlAnswers:
    """What NVML said of one GPU; None where it does not support the question or did not say."""

    retired_pages_pending: bool | None = None
    """Pages retired for uncorrectable errors, waiting for a reset (GPUs before Ampere)."""
    remapped_rows_pending: bool | None = None
    """A memory row remapped for an uncorrectable error, waiting for a reset (Ampere on)."""
    remapping_failed: bool | None = None
    """A row could not be remapped: the GPU's memory has no spare row left."""
    recovery_action: int | None = None
    """``NVML_FI_DEV_GET_GPU_RECOVERY_ACTION``: 0 none, else what the driver asks for."""
    uncorrectable_ecc: int | None = None
    """Uncorrectable ECC errors since the driver loaded (the volatile counter)."""
    error: str | None = None
    """NVML's error for a question it should have answered (the GPU lost, say)."""

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


RECOVERY_ACTIONS = {1: "a GPU reset", 2: "a node reboot", 3: "a drain of its peer-to-peer "
                    "traffic", 4: "a drain and a GPU reset", 5: "a recovery of its IMEX domain",
                    6: "a bus reset", 7: "a system reboot"}
"""NVML's ``NVML_GPU_RECOVERY_ACTION_*`` values (0 is none), as what the driver asks for."""

NVML_FI_DEV_GET_GPU_RECOVERY_ACTION = 230
"""The field id, for a ``pynvml`` too old to name it (NVML answers "not supported" then)."""


def nvml_problems(answers: NvmlAnswers, baseline: NvmlAnswers | None = None
                  ) -> list[tuple[str, str]]:
    """What makes a GPU unfit, from NVML's answers: (kind, reason) pairs; empty when fit.

    ``baseline``: the answers when the job (or the caller) armed; uncorrectable ECC errors
    count from it, else from the driver's load. A question NVML did not answer counts as fit.
    """
    found: list[tuple[str, str]] = []
    if answers.error is not None:
        found.append(("gpu_nvml", f"NVML cannot answer for the GPU: {answers.error}"))
    action = answers.recovery_action
    if action:
        what = RECOVERY_ACTIONS.get(action, f"recovery action {action}")
        found.append(("gpu_recovery_action", f"the driver asks for {what} "
                      f"(NVML recovery action {action})"))
    if answers.remapping_failed:
        found.append(("gpu_row_remap", "a memory row could not be remapped (the GPU has no "
                      "spare row left)"))
    if answers.remapped_rows_pending:
        found.append(("gpu_row_remap", "a row remapping is pending (it needs a reset)"))
    if answers.retired_pages_pending:
        found.append(("gpu_retired_pages", "retired pages pending (it needs a reset)"))
    ecc = answers.uncorrectable_ecc
    if ecc is not None:
        before = baseline.uncorrectable_ecc if baseline is not None else None
        if before is None and ecc > 0:
            found.append(("gpu_ecc", f"{ecc} uncorrectable ECC error(s) since the driver "
                          "loaded"))
        elif before is not None and ecc > before:
            found.append(("gpu_ecc", f"{ecc - before} uncorrectable ECC error(s) since the "
                          f"job started ({ecc} since the driver loaded)"))
    return found


def nvml_verdict(answers: NvmlAnswers, baseline: NvmlAnswers | None = None) -> str | None:
    """Why NVML's answers make a GPU unfit (:func:`nvml_problems`, joined), or None."""
    found = nvml_problems(answers, baseline)
    return "; ".join(reason for _, reason in found) if found else None


def _unsupported(nvml: Any, error: Exception) -> bool:
    """NVML's "this GPU or driver has no such question", not a fault of the GPU."""
    codes = {getattr(nvml, name, None)
             for name in ("NVML_ERROR_NOT_SUPPORTED", "NVML_ERROR_FUNCTION_NOT_FOUND")} - {None}
    return (getattr(error, "value", None) in codes or "NotSupported" in type(error).__name__
            or "Not Supported" in str(error))


def read_nvml(nvml: Any, handle: Any) -> NvmlAnswers:
    """Asks NVML (the ``pynvml`` module, already initialised) its questions of one GPU."""
    errors: list[str] = []

    def ask(what: str, query: Callable[[], Any]) -> Any:
        try:
            return query()
        except Exception as e:  # NVML's own error: unsupported is no answer, others are told
            if not _unsupported(nvml, e):
                errors.append(f"{what}: {e}")
            return None

    def recovery_action() -> int | None:
        field = getattr(nvml, "NVML_FI_DEV_GET_GPU_RECOVERY_ACTION",
                        NVML_FI_DEV_GET_GPU_RECOVERY_ACTION)
        value = nvml.nvmlDeviceGetFieldValues(handle, [field])[0]
        return int(value.value.uiVal) if value.nvmlReturn == 0 else None

    pending = ask("retired pages", lambda: nvml.nvmlDeviceGetRetiredPagesPendingStatus(handle))
    rows = ask("remapped rows", lambda: nvml.nvmlDeviceGetRemappedRows(handle))
    ecc = ask("ECC errors", lambda: nvml.nvmlDeviceGetTotalEccErrors(
        handle, nvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, nvml.NVML_VOLATILE_ECC))
    action = ask("recovery action", recovery_action)
    return NvmlAnswers(
        retired_pages_pending=None if pending is None else bool(pending),
        remapped_rows_pending=None if rows is None else bool(rows[2]),
        remapping_failed=None if rows is None else bool(rows[3]),
        recovery_action=action, uncorrectable_ecc=None if ecc is None else int(ecc),
        error="; ".join(errors) or None)


def nvml_module() -> Any:
    """``pynvml``, or None where it is not installed."""
    try:
        import pynvml  # type: ignore[import-not-found]
    except ImportError:
        return None
    return pynvml


def read_rank_nvml(device: RankDevice) -> NvmlAnswers | None:
    """NVML's answers for the rank's GPU, asked by PCI bus id, else UUID; None without NVML
    (no ``pynvml``, no driver, or CUDA named the GPU by neither)."""
    nvml = nvml_module()
    if nvml is None or not (device.pci_bus_id or device.uuid):
        return None
    try:
        nvml.nvmlInit()
    except Exception:
        return None  # no driver library: NVML has nothing to say
    try:
        if device.pci_bus_id:
            handle = nvml.nvmlDeviceGetHandleByPciBusId(device.pci_bus_id)
        else:
            handle = nvml.nvmlDeviceGetHandleByUUID(device.uuid)
        return read_nvml(nvml, handle)
    except Exception as e:  # the driver cannot find or answer for the GPU CUDA uses
        return NvmlAnswers(error=f"{device.describe()}: {e}")
    finally:
        with contextlib.suppress(Exception):  # nothing is lost when the shutdown fails
            nvml.nvmlShutdown()


# -- the rank's device, checked on that device ---------------------------------------------------

@dataclasses.dataclass(frozen=True)
class ArmedDevice:
    """The rank's device and NVML's answers for it, taken when the caller arms: what a later
    :meth:`check` compares with."""

    device: RankDevice | None = None
    baseline: NvmlAnswers | None = None

    @classmethod
    def arm(cls, bound: torch.device | None = None,
            nvml: Callable[[RankDevice], NvmlAnswers | None] = read_rank_nvml) -> ArmedDevice:
        device = capture_rank_device(bound)
        return cls(device, nvml(device) if device is not None else None)

    def at_failure(self, bound: torch.device | None,
                   capture: Callable[[torch.device | None], RankDevice | None]
                   = capture_rank_device) -> ArmedDevice:
        """The rank's device as a failure finds it, read on the caller's thread (the main
        thread, where the script set its device). A group bound to its device (``bound``, NCCL's
        ``device_id``) names it for good. Otherwise the device at arming may be none (CUDA not
        yet in use: a model moved to its GPU inside the training function) or another one (the
        script's ``set_device`` came later): the synchronize and the health check then ran on
        no device, or made a context on GPU 0. A device other than the armed one has no NVML
        baseline: its ECC counts are judged without one."""
        if bound is not None:
            return self
        now = capture(None)
        if now is None or (self.device is not None and now.index == self.device.index):
            return self
        return ArmedDevice(now, None)

    @property
    def index(self) -> int | None:
        return None if self.device is None else self.device.index

    def check(self, limit_s: float, cuda: CudaCalls | None = None,
              nvml: Callable[[RankDevice], NvmlAnswers | None] = read_rank_nvml
              ) -> HealthVerdict:
        return check_device(self.device, limit_s, self.baseline, cuda, nvml)


def check_device(device: RankDevice | None, limit_s: float,
                 baseline: NvmlAnswers | None = None, cuda: CudaCalls | None = None,
                 nvml: Callable[[RankDevice], NvmlAnswers | None] = read_rank_nvml
                 ) -> HealthVerdict:
    """The rank's device, checked on that device: a synchronize from a helper thread that made
    it its current device (a hung kernel or device does not finish; a sticky CUDA error is
    raised by it), then NVML's answers for that GPU, both in that thread under ``limit_s``."""
    started = time.monotonic()
    if device is None:
        return HealthVerdict(True, "no CUDA device in use", 0.0, {"device": None})
    calls = cuda if cuda is not None else CudaCalls.of_torch()
    seen: list[int] = []
    synchronized: list[bool] = []
    asked: list[NvmlAnswers | None] = []

    def synchronize_then_ask_nvml() -> None:
        seen.append(calls.current_device())  # the thread's own: what its synchronize waits on
        calls.synchronize(device.index)
        synchronized.append(True)
        asked.append(nvml(device))

    finished, error = within(synchronize_then_ask_nvml, limit_s, device.index, calls)
    evidence: dict[str, Any] = {"device": dataclasses.asdict(device),
                                "thread_device": seen[0] if seen else None}
    if not finished:
        step = "NVML's answer for" if synchronized else "torch.cuda.synchronize() of"
        return HealthVerdict(False, f"{step} {device.describe()} did not come within "
                             f"{limit_s:g} s", time.monotonic() - started, evidence)
    if error is not None:
        reason = f"{device.describe()}: {type(error).__name__}: {error}".splitlines()[0]
        return HealthVerdict(False, reason, time.monotonic() - started, evidence)
    answers = asked[0]
    evidence["nvml"] = None if answers is None else answers.to_json()
    evidence["nvml_baseline"] = None if baseline is None else baseline.to_json()
    problem = None if answers is None else nvml_verdict(answers, baseline)
    seconds = time.monotonic() - started
    if problem is not None:
        return HealthVerdict(False, f"NVML: {device.describe()}: {problem}", seconds, evidence)
    said = "NVML found nothing" if answers is not None else "no NVML answer"
    return HealthVerdict(True, f"{device.describe()} synchronized from its own thread; {said}",
                         seconds, evidence)
