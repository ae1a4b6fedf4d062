"""Whether a survivor's device is fit to rejoin after its groups were torn down.

A failure that ended a peer may have hurt this process's GPU too: a kernel that never ends, a
sticky CUDA error (an illegal address, an ECC error: every later call on the context fails),
or a fault the driver reports through NVML. A survivor that rejoined with such a device would
fail the new generation at once, and the agent would restart everything; replacing it alone
costs one new process. So before it rejoins, a survivor checks (:func:`device_health`):

1. a ``torch.cuda.synchronize()`` of its device, under a time limit (a kernel still running
   after the abort, or a hung device, does not finish in it);
2. CUDA's sticky errors, which that synchronize raises;
3. NVML's view of its GPU where ``pynvml`` is installed: the device answers, and has no
   pending retired pages (an uncorrectable memory error waiting for a reset).

A process without CUDA (gloo on CPU) passes at once. The check returns why the device is unfit,
or None; :class:`elasticft.recovery.groups.GroupOps` carries it as the seam tests replace.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import torch


def within(call: Callable[[], Any], limit_s: float) -> tuple[bool, BaseException | None]:
    """Runs ``call`` in a daemon thread for at most ``limit_s``: (finished, its error)."""
    outcome: list[BaseException | None] = []

    def run() -> None:
        try:
            call()
            outcome.append(None)
        except BaseException as e:  # reported to the caller, whatever it was
            outcome.append(e)

    thread = threading.Thread(target=run, name="elasticft-bounded", daemon=True)
    thread.start()
    thread.join(limit_s)
    return (bool(outcome), outcome[0] if outcome else None)


def _nvml_problem(index: int) -> str | None:
    try:
        import pynvml  # type: ignore[import-not-found]
    except ImportError:
        return None
    try:
        pynvml.nvmlInit()
        try:
            handle = pynvml.nvmlDeviceGetHandleByIndex(index)
            if pynvml.nvmlDeviceGetRetiredPagesPendingStatus(handle):
                return f"NVML: GPU {index} has retired pages pending (it needs a reset)"
        finally:
            pynvml.nvmlShutdown()
    except Exception as e:  # NVML's own error: the driver cannot answer for the device
        if "NotSupported" in type(e).__name__ or "Not Supported" in str(e):
            return None
        return f"NVML: GPU {index}: {e}"
    return None


def device_health(limit_s: float) -> str | None:
    """Why this process's CUDA device is unfit to rejoin, or None (see the module)."""
    if not (torch.cuda.is_available() and torch.cuda.is_initialized()):
        return None
    index = torch.cuda.current_device()
    finished, error = within(torch.cuda.synchronize, limit_s)
    if not finished:
        return f"torch.cuda.synchronize() of GPU {index} did not finish within {limit_s:.0f} s"
    if error is not None:
        return f"GPU {index}: {type(error).__name__}: {error}".splitlines()[0]
    return _nvml_problem(index)
