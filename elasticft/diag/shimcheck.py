"""The NCCL shim's self-check: does this worker's NCCL traffic get timed, and if not, why.

The worker runs it once, right after ``import torch`` (which loads NCCL) and before the script
can make its first NCCL call (:mod:`elasticft.diag.autoinstall`, :func:`elasticft.init`). It asks
the preloaded shim (its exported ``elasticft_shim_probe``) whether it records, which library
defines NCCL and its version, and which of the shim's entry points that NCCL lacks, then writes
the answer to the rank's status file (JSON; :class:`elasticft.diag.ring.RingFiles` ``.status``:
an anonymous file the agent holds, or ``rank-<rank>.nccl.status`` beside the rings of a worker
run by hand), in place, so that it may have no name. The agent's monitor
reads it, writes it to the event log (kind ``nccl_timings``) and logs one line; ``elasticft
status --run-dir`` shows the newest per node. A shim that is inactive changes nothing in NCCL's
behaviour; the agent keeps detecting with the Python recorder, heartbeats and process state.

The probe proves that the shim is loaded and that NCCL is in the process, not that torch's NCCL
calls pass through the shim: an NCCL linked into ``libtorch_cuda.so`` can call itself without
the dynamic linker, and the shim would then see nothing. So the recorder keeps timing NCCL
groups in Python until the calls themselves settle it (:class:`InterceptionCheck`): the shim's
record counter moved (torch's calls reach it; the Python wrappers step aside), or
:data:`BYPASS_AFTER_CALLS` NCCL collectives went by with the counter still (the status file is
rewritten as inactive, with the reason, and the Python wrappers go on timing NCCL groups).
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import json
import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

SHIM_ENV = "ELASTICFT_DIAG_SHIM"
"""``1``: the agent preloaded the NCCL shim in this worker (read here and by the shim itself)."""

EVENT_KIND = "nccl_timings"
_PROBE = "elasticft_shim_probe"
_RECORDS = "elasticft_shim_records"

UNVERIFIED, THROUGH_SHIM, BYPASSED = "unverified", "through_shim", "bypassed"
BYPASS_AFTER_CALLS = 8
"""NCCL collectives torch must issue, with the shim's record counter not moved since the
self-check, before the worker concludes that torch's NCCL calls do not reach the shim. Any NCCL
call through the shim moves it (communicator creation included), so one is enough the other way."""
BYPASS_REASON = ("torch's NCCL calls do not reach the shim (NCCL linked into another library "
                 "calls itself directly); collectives on NCCL groups are timed in Python")


@dataclasses.dataclass(frozen=True)
class ShimStatus:
    """What the shim found in this process."""

    loaded: bool
    recording: bool = False
    reason: str = ""
    version: int = 0
    library: str = ""
    missing: tuple[str, ...] = ()
    cuda_events: bool = False
    cudart: str = ""

    @property
    def active(self) -> bool:
        return self.loaded and self.recording and self.version > 0

    @property
    def why_inactive(self) -> str:
        if not self.loaded:
            return "the shim is not loaded in the worker (LD_PRELOAD)"
        if not self.recording:
            return self.reason or "the shim does not record"
        if self.version <= 0:
            return "no NCCL library is loaded in the worker (torch without NCCL?)"
        return ""

    def message(self) -> str:
        if not self.active:
            return f"NCCL timings inactive: {self.why_inactive}"
        timing = (f"GPU time from CUDA events ({self.cudart})" if self.cuda_events
                  else "host-side completion only (no usable CUDA runtime)")
        text = f"NCCL timings active: NCCL {version_text(self.version)} from {self.library}; "
        text += timing
        if self.missing:
            text += f"; not in this NCCL: {', '.join(self.missing)}"
        return text

    def to_json(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "active": self.active, "message": self.message()}


def version_text(code: int) -> str:
    """NCCL's version code as text (2.30.7 is 23007; before 2.9 it was 2708 for 2.7.8)."""
    if code >= 10000:
        return f"{code // 10000}.{code // 100 % 100}.{code % 100}"
    return f"{code // 1000}.{code // 100 % 10}.{code % 100}"


def probe() -> ShimStatus:
    """Asks the shim loaded in this process (none: ``loaded=False``)."""
    try:
        function = getattr(ctypes.CDLL(None), _PROBE)
    except (OSError, AttributeError):
        return ShimStatus(loaded=False)
    function.restype = ctypes.c_int
    function.argtypes = [ctypes.c_char_p, ctypes.c_size_t]
    buffer = ctypes.create_string_buffer(8192)
    function(buffer, len(buffer))
    found = json.loads(buffer.value.decode(errors="replace"))
    return ShimStatus(loaded=True, recording=bool(found["recording"]), reason=found["reason"],
                      version=int(found["version"]), library=found["library"],
                      missing=tuple(found["missing"]), cuda_events=bool(found["cuda_events"]),
                      cudart=found["cudart"])


def interception(records_now: int, records_at_check: int, nccl_calls: int) -> str:
    """Whether torch's NCCL calls reach the shim: :data:`THROUGH_SHIM` once its record counter
    has moved since the self-check, :data:`BYPASSED` when ``nccl_calls`` NCCL collectives
    (at least :data:`BYPASS_AFTER_CALLS`) left it still, else :data:`UNVERIFIED`."""
    if records_now > records_at_check:
        return THROUGH_SHIM
    if nccl_calls >= BYPASS_AFTER_CALLS:
        return BYPASSED
    return UNVERIFIED


def records_counter() -> Callable[[], int] | None:
    """The preloaded shim's record counter (``elasticft_shim_records``); None without one."""
    try:
        function = getattr(ctypes.CDLL(None), _RECORDS)
    except (OSError, AttributeError):
        return None
    function.restype = ctypes.c_uint64
    function.argtypes = []
    return lambda: int(function())


class InterceptionCheck:
    """Settles, from the first NCCL collectives, whether the shim sees torch's NCCL calls.

    The recorder calls :meth:`after_nccl_call` after each collective it wraps on an NCCL group
    while :attr:`verdict` is :data:`UNVERIFIED`; ``on_bypass`` runs once if the verdict is
    :data:`BYPASSED`. The counter's value at construction (right after the self-check, before
    the script's first NCCL call) is the reference.
    """

    def __init__(self, counter: Callable[[], int], on_bypass: Callable[[], None]) -> None:
        self._counter = counter
        self._on_bypass = on_bypass
        self._at_check = counter()
        self._nccl_calls = 0
        self.verdict = UNVERIFIED

    def after_nccl_call(self) -> None:
        if self.verdict != UNVERIFIED:
            return
        self._nccl_calls += 1
        self.verdict = interception(self._counter(), self._at_check, self._nccl_calls)
        if self.verdict == BYPASSED:
            self._on_bypass()

    def peek(self) -> str:
        """Settles :data:`THROUGH_SHIM` if NCCL calls made from C++ (communicator creation,
        DDP's parameter broadcast) already moved the counter; counts no call."""
        if self.verdict == UNVERIFIED and self._counter() > self._at_check:
            self.verdict = THROUGH_SHIM
        return self.verdict


def expected(env: Mapping[str, str]) -> bool:
    """The agent injected the shim into this worker."""
    return env.get(SHIM_ENV) is not None or "_nccl_shim" in env.get("LD_PRELOAD", "")


def _written(path: Path) -> bool:
    try:
        return path.stat().st_size > 0
    except OSError:
        return False


def report(path: Path | None, rank: int, env: Mapping[str, str]) -> ShimStatus | None:
    """Runs the self-check once per worker process and writes it to the status file ``path``
    (never raises; None without a status file)."""
    try:
        if path is None or not expected(env) or _written(path):
            return None
        status = probe()
        write_status(path, rank, status)
        return status
    except Exception:  # diagnostics never stop a training script
        return None


def write_status(path: Path, rank: int, status: ShimStatus) -> None:
    """Rewrites the status file in place (it may be a file with no name, which cannot be
    replaced): the content first, then the length. A reader that meets it half written finds
    no JSON and reads it again at its next poll (:func:`read_status`)."""
    data = json.dumps({**status.to_json(), "pid": os.getpid(), "rank": rank}).encode()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        os.pwrite(fd, data, 0)
        os.ftruncate(fd, len(data))
    finally:
        os.close(fd)


def interception_check(path: Path | None, rank: int, status: ShimStatus | None
                       ) -> InterceptionCheck | None:
    """The check for a worker whose self-check found the shim active (else None): on a bypass
    the status file is rewritten as inactive, with :data:`BYPASS_REASON`."""
    counter = records_counter() if status is not None and status.active else None
    if counter is None or status is None or path is None:
        return None

    def bypassed() -> None:
        # The agent's monitor picks the new status up and says it in one line.
        with contextlib.suppress(OSError):  # diagnostics never stop a training script
            write_status(path, rank, dataclasses.replace(status, recording=False,
                                                         reason=BYPASS_REASON))

    try:
        return InterceptionCheck(counter, bypassed)
    except Exception:  # no check: the Python wrappers then time NCCL groups as they do gloo
        return None


def read_status(path: Path) -> dict[str, Any] | None:
    """The status a worker wrote, or None while there is none, or it is half written (agent
    side)."""
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def changed_status(path: Path | None, seen: tuple[int, int] | None
                   ) -> tuple[tuple[int, int], dict[str, Any]] | None:
    """The status file's version (mtime ns, size) and content when it changed since the version
    ``seen``; None when it did not, or when it is absent or unreadable."""
    if path is None:
        return None
    try:
        stat = path.stat()
    except OSError:
        return None
    version = (stat.st_mtime_ns, stat.st_size)
    if version == seen:
        return None
    status = read_status(path)
    return None if status is None else (version, status)
