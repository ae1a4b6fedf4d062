"""What in-process recovery on NCCL needs of the worker's environment and of NCCL itself.

elasticft ends a survivor's NCCL communicators itself (the monitor's abort, under the hard
limit of ``--recovery-inprocess-teardown-limit-s``). torch's own watchdog must not end the
process first, nor abort the communicators beside elasticft, and NCCL must be able to abort and
make communicators again in one process. On a node with GPUs the agent gives these defaults to
the workers of a job that runs under ``InProcess`` (:func:`worker_env`), and to no other job:
they cost a job without in-process recovery NVLink SHARP's bandwidth and torch's own handling
of a failed collective. The agent knows that a job runs under ``InProcess`` from its script,
before the first start, when the script names in-process recovery (:func:`script_arms`: it
imports ``elasticft.inprocess`` or a framework integration), and otherwise when its workers arm
(their ``armed`` records): the workers of such a job's first start make their groups with
torch's settings, and every start after it with these; a worker on NCCL that armed without them
says so (:func:`missing`). A variable already set in the agent's environment is left as it is:

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
``TORCH_NCCL_WAIT_TIMEOUT_DUMP_MILSEC=250``
    torch 2.13's watchdog, on a collective's error it sees before elasticft's abort (NCCL's
    ``ncclRemoteError`` when the peer's connection closes), broadcasts the flight recorder's
    dump signal and then sleeps ``4 ×`` this many milliseconds (``Watchdog::runLoop`` in
    ``ProcessGroupNCCL.cpp``: ``sleep_for(getDumpTimeout() * 4)``, read by the
    ``HeartbeatMonitor``'s constructor, 15 000 by default: a minute) while it holds the group's
    ``workMetaListMutex_``, which the main thread's next collective and the group's shutdown
    wait for; the sleep comes whatever ``TORCH_NCCL_ASYNC_ERROR_HANDLING`` says. 250 ms makes
    it one second. The same variable bounds the heartbeat monitor's wait for a flight
    recorder dump, so a dump slower than that is given up. Read from torch's source (the
    variable's name and the ``* 4`` are torch's); no GPU has shown it.

NCCL 2.28.3 to 2.28.8 have a known fault in ``ncclCommAbort`` (it can hang or corrupt state
when a communicator is aborted while a kernel is pending): :func:`abort_warning` says so, and a
worker on NCCL logs it when recovery arms.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

HEARTBEAT_FLOOR_S = 480
"""torch's default heartbeat timeout, kept unless the hard limit needs more."""
_BROKEN_ABORT = ((2, 28, 3), (2, 28, 8))


DUMP_WAIT_MS = 250
"""``TORCH_NCCL_WAIT_TIMEOUT_DUMP_MILSEC``: the watchdog's sleep after an error is 4 × this."""


def defaults(teardown_limit_s: float) -> dict[str, str]:
    """The in-process NCCL settings above, for this hard limit of the teardown (pure)."""
    heartbeat = max(HEARTBEAT_FLOOR_S, int(4 * teardown_limit_s) + 60)
    return {
        "TORCH_NCCL_ASYNC_ERROR_HANDLING": "0",
        "TORCH_NCCL_RETHROW_CUDA_ERRORS": "0",
        "NCCL_NVLS_ENABLE": "0",
        "TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC": str(heartbeat),
        "TORCH_NCCL_WAIT_TIMEOUT_DUMP_MILSEC": str(DUMP_WAIT_MS),
    }


def worker_env(environ: Mapping[str, str], teardown_limit_s: float, *, gpus: bool,
               in_process: bool) -> dict[str, str]:
    """What the agent adds to its workers' environment for NCCL (pure): the defaults above,
    less what ``environ`` (the agent's) already sets, on a node with GPUs (``gpus``) for a job
    that runs under ``InProcess`` (``in_process``); nothing for any other job."""
    if not (gpus and in_process):
        return {}
    return {name: value for name, value in defaults(teardown_limit_s).items()
            if name not in environ}


IN_PROCESS_MARKS = ("elasticft.inprocess", "elasticft.integrations",
                    "elasticft.recovery.inprocess", "InProcess(")
"""What a script that arms in-process recovery names: the package, a framework integration (the
Lightning strategies, the Trainer's ``train``, torchtitan's), the earlier releases' module, or
the class itself."""


def script_arms(text: str) -> bool:
    """Whether a training script's source names in-process recovery (pure)."""
    return any(mark in text for mark in IN_PROCESS_MARKS)


def entry_script_arms(args: Sequence[object]) -> bool:
    """Whether the worker's entry script (the first argument that names a ``.py`` file)
    names in-process recovery; False when there is none to read (``-m module``, a wrapper)."""
    script = next((Path(str(a)) for a in args if str(a).endswith(".py")), None)
    try:
        return script is not None and script_arms(script.read_text(errors="replace"))
    except OSError:
        return False


def missing(environ: Mapping[str, str]) -> list[str]:
    """The settings a survivor on NCCL needs that ``environ`` (a worker's) lacks (pure):
    watchdog error handling other than ``0`` ends or aborts beside elasticft's abort, and
    torch's dump wait holds the group for a minute."""
    found = []
    if environ.get("TORCH_NCCL_ASYNC_ERROR_HANDLING", "3") != "0":
        found.append("TORCH_NCCL_ASYNC_ERROR_HANDLING=0")
    if "TORCH_NCCL_WAIT_TIMEOUT_DUMP_MILSEC" not in environ:
        found.append(f"TORCH_NCCL_WAIT_TIMEOUT_DUMP_MILSEC={DUMP_WAIT_MS}")
    return found


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
