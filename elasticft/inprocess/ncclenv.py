"""What in-process recovery on NCCL needs of the worker's environment and of NCCL itself.

elasticft ends a survivor's NCCL communicators itself (the monitor's abort, under the hard
limit of ``--recovery-inprocess-teardown-limit-s``). torch's own watchdog must not end the
process first, nor abort the communicators beside elasticft, and NCCL must be able to abort and
make communicators again in one process. On a node with GPUs the agent gives every worker these
defaults (:func:`worker_env`); a variable already set in the agent's environment is left as it
is:

``TORCH_NCCL_ASYNC_ERROR_HANDLING=0``
    as torch's documentation of ``_abort_process_group`` (the call elasticft ends a group with)
    asks: the watchdog handles no error or timeout itself, so the only abort of a communicator
    is elasticft's. With ``2`` ("clean up only") the watchdog aborts the communicators on a
    communicator error or a collective's timeout from its own thread, at any moment, while the
    monitor may be aborting the same group and the survivor's teardown destroying it; with torch's
    default (``3``, or ``1`` as torchrun sets it) it tears the whole process down, survivor
    included. What the watchdog would have acted on is seen by elasticft instead: a dead peer by
    the agent (its exit, or its node's loss), which then interrupts the survivors; a collective
    that never completes by the hang detection (:mod:`elasticft.diag`), well before NCCL's
    10-minute timeout, in a job without in-process recovery too (its workers are then restarted,
    not left to torch's teardown). A user who sets the variable keeps it, and with it the race:
    two aborts of one communicator from two threads.
``TORCH_NCCL_RETHROW_CUDA_ERRORS=0``
    a CUDA error seen by the watchdog is not rethrown there (which would end the process); the
    survivor's health check then decides whether its device may rejoin.
``NCCL_NVLS_ENABLE=0``
    NVLink SHARP buffers are not released by an abort, so a communicator made again in the
    same process could fail; without NVLS, abort and re-creation are safe.
``TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC``
    torch's heartbeat monitor ends a process whose watchdog is stuck for this long (480 s by
    default); it is set above the hard limit of the teardown, so that a slow abort is judged
    by elasticft's limit first.

NCCL 2.28.3 to 2.28.8 have a known fault in ``ncclCommAbort`` (it can hang or corrupt state
when a communicator is aborted while a kernel is pending): :func:`abort_warning` says so, and a
worker on NCCL logs it when recovery arms.
"""

from __future__ import annotations

from collections.abc import Mapping

HEARTBEAT_FLOOR_S = 480
"""torch's default heartbeat timeout, kept unless the hard limit needs more."""
_BROKEN_ABORT = ((2, 28, 3), (2, 28, 8))


def worker_env(environ: Mapping[str, str], teardown_limit_s: float) -> dict[str, str]:
    """The defaults above, less what ``environ`` (the agent's) already sets (pure)."""
    heartbeat = max(HEARTBEAT_FLOOR_S, int(4 * teardown_limit_s) + 60)
    defaults = {
        "TORCH_NCCL_ASYNC_ERROR_HANDLING": "0",
        "TORCH_NCCL_RETHROW_CUDA_ERRORS": "0",
        "NCCL_NVLS_ENABLE": "0",
        "TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC": str(heartbeat),
    }
    return {name: value for name, value in defaults.items() if name not in environ}


def abort_warning(version: tuple[int, ...] | None) -> str | None:
    """Why this NCCL version makes in-process recovery unsafe, or None (pure)."""
    if version is None or len(version) < 3:
        return None
    low, high = _BROKEN_ABORT
    if low <= tuple(version[:3]) <= high:
        found = ".".join(str(v) for v in version[:3])
        return (f"NCCL {found} is in 2.28.3-2.28.8, whose ncclCommAbort can hang or leave a "
                f"communicator unusable: in-process recovery may fall back to a full restart; "
                f"use NCCL 2.28.9 or later (or before 2.28.3)")
    return None


def nccl_version() -> tuple[int, ...] | None:
    """The NCCL version torch loaded, or None where torch has no NCCL."""
    try:
        import torch.cuda.nccl as nccl

        version = nccl.version()
    except Exception:  # a CPU build, or no library
        return None
    return tuple(version) if isinstance(version, tuple) else None
