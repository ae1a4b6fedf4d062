"""Failure classification: what kind of failure a dead worker had, from the evidence it left.

Evidence comes from three places, best first: torch's error file (written by ``@record``), the
last Python traceback in the worker's captured stderr, and the exit code or signal. The class
decides what the policy may do: an infrastructure fault is worth a restart, a bug in the user's
code is not (restarting it only fails again and hides the bug).

A traceback also says whose code raised. Frames of the standard library and of installed
packages (torch) are the tools the code called, not the code; the innermost frame that is
neither is where it went wrong. When that frame is elasticft's own (its restore path, say), the
failure is elasticft's (:attr:`FailureClass.ELASTICFT`), not the user's; the innermost frame of
the user's own code is kept either way (:attr:`FailureRecord.user_frame`): it is where the
policy looks to tell a failure that repeats from a new one. elasticft's frames that only pass a
user's call through (the diagnostics wrappers of torch's collectives, the worker bootstraps)
count as the tools.
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import json
import re
import signal
import sysconfig
from pathlib import Path
from typing import Any


class FailureClass(str, enum.Enum):
    SIGNAL_CRASH = "signal_crash"
    """Killed by a signal it did not ask for: SIGKILL (OOM killer, kill -9), SIGSEGV, SIGBUS..."""
    INFRASTRUCTURE = "infrastructure"
    """Communication or device errors: gloo, NCCL, CUDA, connection reset, store timeouts."""
    USER_CODE = "user_code"
    """A bug in the training script: SyntaxError, NameError, TypeError, a failed assertion..."""
    STOP_REQUESTED = "stop_requested"
    """The worker was sent SIGTERM/SIGINT from outside the agent."""
    HANG = "hang"
    """Alive but making no progress (reported by diagnostics, never by an exit)."""
    SLOW = "slow"
    """Making progress, but steadily slower than its peers for long enough (reported by
    diagnostics with ``--slow-action restart``): fail-slow, which points at its node."""
    NUMERIC = "numeric"
    """Training diverged: a NaN/inf or spiking loss (reported by diagnostics). Every replica's
    weights may hold it, so recovery resumes from a snapshot, never a just-in-time checkpoint."""
    ELASTICFT = "elasticft"
    """An exception raised in elasticft's own code (its checkpoint restore, say), not the user's
    nor a communication fault: worth a restart, and a bug to report when it repeats."""
    UNKNOWN = "unknown"
    """Exited non-zero with nothing that names a cause."""


# Exceptions that a restart cannot fix: the code itself is wrong.
USER_EXCEPTIONS = frozenset(
    {
        "SyntaxError",
        "IndentationError",
        "TabError",
        "ImportError",
        "ModuleNotFoundError",
        "NameError",
        "UnboundLocalError",
        "AttributeError",
        "TypeError",
        "ValueError",
        "KeyError",
        "IndexError",
        "AssertionError",
        "ZeroDivisionError",
        "NotImplementedError",
        "RecursionError",
        "FileNotFoundError",
    }
)

# Exceptions that say the job cannot go on as launched, whatever is restarted: the checkpoint it
# would resume from does not fit its model (a relaunch whose arguments changed its shapes).
# Classed as the user's (their launch must change) and never restarted (elasticft.addon.policy).
UNRESTARTABLE_EXCEPTIONS = frozenset({"StateMismatch"})

# torch.distributed's own error types, and message fragments of communication and device faults.
INFRA_EXCEPTIONS = frozenset(
    {
        "DistError",
        "DistBackendError",
        "DistNetworkError",
        "DistStoreError",
        "DistQueueEmptyError",
        "ConnectionError",
        "ConnectionResetError",
        "ConnectionRefusedError",
        "ConnectionAbortedError",
        "BrokenPipeError",
        "TimeoutError",
        "OutOfMemoryError",
        # In-process recovery's interrupt of a survivor whose peer failed (a BaseException,
        # named by neither suffix below): a consequence of that failure, not a fault of its own.
        "PeerInterrupted",
    }
)
INFRA_PATTERN = re.compile(
    r"gloo|nccl|cuda|cudnn|cublas|connection (reset|refused|closed|timed out)|"
    r"broken pipe|connectFullMesh|timed out waiting|socket timeout|ecc error|"
    r"device-side assert|unhandled system error|peer closed|TCPStore|DistStore",
    re.IGNORECASE,
)
DEVICE_FAULT = re.compile(
    r"cuda error|cuda failure|device-side|illegal memory|illegal address|ecc|uncorrectable|"
    r"\bxid\b|launch failure|device failed the health check|device is lost|fallen off the bus",
    re.IGNORECASE)
"""The one list of device faults: messages that say a GPU itself is unfit (its memory, its bus,
its health check). A worker that died of one gets no replacement on that GPU. Two judges read
more into a failure than the GPU's own fault, each for a reason of its own:
:func:`process_unusable` (what a process may not go on after) and :func:`device_evidence`
(what counts against a node)."""

_CUDA_STATE = re.compile(r"cuda|out ?of ?memory", re.IGNORECASE)
"""Beyond a device fault, what may leave a process's CUDA state unusable or full: any CUDA
error (CUDA's errors are "sticky": the context is lost; NCCL's "unhandled cuda error" is one),
and running out of memory (the GPU stays usable, the process's allocations do not)."""

_DEVICE_LIBRARIES = re.compile(r"cuda|nccl|cudnn|cublas|bus error|nvlink|hardware",
                               re.IGNORECASE)
"""Beyond a device fault, the node's device libraries and links failing: evidence against the
node, though an NCCL error is often only the echo of a peer's death."""


def device_fault(text: str) -> bool:
    """Whether ``text`` (an exception and its message, a worker's reason for leaving) names a
    fault of the GPU itself (pure)."""
    return bool(DEVICE_FAULT.search(text))


def process_unusable(text: str) -> bool:
    """Whether the process that failed with ``text`` cannot go on in its process: a device
    fault, any CUDA error or running out of memory (pure); only a new process goes on."""
    return device_fault(text) or bool(_CUDA_STATE.search(text))


def device_evidence(text: str) -> bool:
    """Whether ``text`` is evidence against the node's devices: a device fault, or its CUDA,
    NCCL or interconnect failing (pure)."""
    return device_fault(text) or bool(_DEVICE_LIBRARIES.search(text))


_EXC_LINE = re.compile(r"^(?P<type>[A-Za-z_][\w.]*(Error|Exception|Interrupt|Interrupted|Exit|"
                       r"Warning|StateMismatch)|"
                       r"[A-Za-z_][\w.]*Error)(: (?P<msg>.*))?$")
_FRAME_LINE = re.compile(r'^\s*File "(?P<file>[^"]+)", line (?P<line>\d+), in (?P<func>.+)$')

_CRASH_SIGNALS = {
    signal.SIGKILL, signal.SIGSEGV, signal.SIGBUS, signal.SIGABRT, signal.SIGILL, signal.SIGFPE,
}
_STOP_SIGNALS = {signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT}


@dataclasses.dataclass(frozen=True)
class FailureRecord:
    """One failed worker and what is known about why."""

    rank: int
    local_rank: int
    pid: int
    exitcode: int
    failure_class: FailureClass
    signal: str | None = None
    exception: str | None = None
    """Exception type name, e.g. ``ZeroDivisionError``."""
    message: str | None = None
    location: str | None = None
    """Innermost frame of the traceback: ``file:line in func``."""
    source: str = "exitcode"
    """Where the evidence came from: error_file, stderr, exitcode or a detector's name."""
    user_frame: str | None = None
    """Innermost frame of the user's own code (not a library's, not elasticft's)."""

    def summary(self) -> str:
        exit_text = f"signal {self.signal}" if self.signal else f"exit {self.exitcode}"
        what = self.exception or exit_text
        if self.message:
            what += f": {self.message}"
        where = f" at {self.location}" if self.location else ""
        if self.user_frame and self.user_frame != self.location:
            where += f" (called from {self.user_frame})"
        return f"rank {self.rank} ({self.failure_class.value}) {what}{where}"

    def to_json(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        data["failure_class"] = self.failure_class.value
        return data


@dataclasses.dataclass(frozen=True)
class ExceptionInfo:
    type_name: str
    message: str
    location: str | None
    """Innermost frame."""
    user_frame: str | None = None
    """Innermost frame in the user's own code."""
    raised_in_elasticft: bool = False
    """The innermost frame that is not a library's is elasticft's own."""


_ELASTICFT_DIR = str(Path(__file__).resolve().parent.parent) + "/"
_INSTALLED_ELASTICFT = ("/site-packages/elasticft/", "/dist-packages/elasticft/")
_PASS_THROUGH = ("diag/recorder.py", "diag/autoinstall.py", "diag/bootstrap/",
                 "agent/warm_bootstrap/")
"""elasticft's modules whose frames only carry a user's call (the collective wrappers, the
worker bootstraps): a library's frames, not elasticft's own."""
_LIBRARY_DIRS = tuple(sorted({
    str(Path(path).resolve()) + "/"
    for key in ("stdlib", "platstdlib", "purelib", "platlib")
    if (path := sysconfig.get_paths().get(key))
}))
_LIBRARY_PARTS = ("/site-packages/", "/dist-packages/")


def _within_elasticft(path: str) -> str | None:
    """``path`` relative to the elasticft package it is in, or None."""
    if path.startswith(_ELASTICFT_DIR):
        return path[len(_ELASTICFT_DIR):]
    for part in _INSTALLED_ELASTICFT:
        at = path.find(part)
        if at >= 0:
            return path[at + len(part):]
    return None


def frame_owner(file: str) -> str:
    """Whose code a traceback frame's file is: ``elasticft``, ``library`` or ``user`` (pure but
    for this install's paths: elasticft's package directory, the standard library's)."""
    if file.startswith("<"):  # <frozen runpy> is the interpreter's; <string> is python -c's
        return "library" if file.startswith("<frozen") else "user"
    path = str(Path(file).resolve())
    inside = _within_elasticft(path)
    if inside is not None:
        return "library" if inside.startswith(_PASS_THROUGH) else "elasticft"
    if path.startswith(_LIBRARY_DIRS) or any(part in path for part in _LIBRARY_PARTS):
        return "library"
    return "user"


def parse_traceback(text: str) -> ExceptionInfo | None:
    """The last exception of the last Python traceback in ``text`` (a stderr log or callstack)."""
    return _last_traceback([line.rstrip("\n") for line in text.splitlines()])[0]


def _last_traceback(lines: list[str]) -> tuple[ExceptionInfo | None, int]:
    """The last traceback's exception and the index of the line after its exception line."""
    start = None
    for i in range(len(lines) - 1, -1, -1):
        if lines[i].startswith("Traceback (most recent call last)") or lines[i].endswith(
            "Traceback (most recent call last):"
        ):
            start = i
            break
    if start is None:
        return None, len(lines)
    frames: list[tuple[str, str]] = []  # (file, "file:line in func"), outermost first
    for i in range(start + 1, len(lines)):
        body = _strip_prefix(lines[i])
        frame = _FRAME_LINE.match(body)
        if frame:
            frames.append((frame["file"], f"{frame['file']}:{frame['line']} in {frame['func']}"))
            continue
        if body.startswith((" ", "\t")) or not body:
            continue
        match = _EXC_LINE.match(body)
        if match:
            type_name = match["type"].rsplit(".", 1)[-1]
            owners = [(frame_owner(file), where) for file, where in frames]
            raiser = next((owner for owner, _ in reversed(owners) if owner != "library"), None)
            return ExceptionInfo(
                type_name, (match["msg"] or "").strip(),
                frames[-1][1] if frames else None,
                user_frame=next((where for owner, where in reversed(owners) if owner == "user"),
                                None),
                raised_in_elasticft=raiser == "elasticft",
            ), i + 1
    return None, len(lines)


# What a C++ runtime prints when it aborts the process (std::terminate, a c10 error's trace).
_ABORT_LINES = ("terminate called", "what():", "frame #", "Exception raised from",
                "<omitting python frames>", "Aborted", "Fatal Python error")


def uncaught_then_aborted(text: str) -> ExceptionInfo | None:
    """The exception of a worker whose uncaught Python exception was followed by a C++ abort
    while the interpreter shut down (a gloo or store thread's ``std::terminate``): its stderr
    ends with the traceback and nothing after it but the runtime's abort message. Such a
    SIGABRT is the exception's aftermath, not a crash of its own."""
    lines = [line.rstrip("\n") for line in text.splitlines()]
    info, after = _last_traceback(lines)
    if info is None:
        return None
    rest = [_strip_prefix(line).strip() for line in lines[after:]]
    if all(not line or line.startswith(_ABORT_LINES) for line in rest):
        return info
    return None


def _strip_prefix(line: str) -> str:
    # torch prefixes worker lines with "[rank<N>]: " (and its tee with "[role<N>]:"); drop them.
    while line.startswith("[") and "]:" in line[:40]:
        line = line.split("]:", 1)[1]
        line = line[1:] if line.startswith(" ") else line
    return line


def read_error_file(path: str | Path | None) -> ExceptionInfo | None:
    """torch's ``@record`` error file: ``{"message": {"message": ..., "extraInfo": {...}}}``."""
    if not path:
        return None
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return None
    message = data.get("message")
    if isinstance(message, dict):
        callstack = message.get("extraInfo", {}).get("py_callstack", "")
        parsed = parse_traceback(callstack) if callstack else None
        if parsed:
            return parsed
        text = str(message.get("message", ""))
    else:
        text = str(message or "")
    head, _, rest = text.partition(": ")
    if head and _EXC_LINE.match(head + ": x"):
        return ExceptionInfo(head.rsplit(".", 1)[-1], rest.strip(), None)
    return None


def read_tail(path: str | Path | None, max_bytes: int = 64 * 1024) -> str:
    if not path:
        return ""
    try:
        with open(path, "rb") as f:
            f.seek(0, 2)
            size = f.tell()
            f.seek(max(0, size - max_bytes))
            return f.read().decode("utf-8", errors="replace")
    except OSError:
        return ""


def classify_exception(info: ExceptionInfo) -> FailureClass:
    if info.type_name in UNRESTARTABLE_EXCEPTIONS:
        return FailureClass.USER_CODE
    if info.type_name in INFRA_EXCEPTIONS or INFRA_PATTERN.search(info.message):
        return FailureClass.INFRASTRUCTURE
    if info.raised_in_elasticft and info.type_name not in ("KeyboardInterrupt", "SystemExit"):
        return FailureClass.ELASTICFT
    if info.type_name in USER_EXCEPTIONS:
        return FailureClass.USER_CODE
    if info.type_name in ("KeyboardInterrupt", "SystemExit"):
        return FailureClass.STOP_REQUESTED
    return FailureClass.UNKNOWN


def classify_exit(
    rank: int,
    local_rank: int,
    pid: int,
    exitcode: int,
    *,
    error_file: str | Path | None = None,
    stderr_file: str | Path | None = None,
) -> FailureRecord:
    """Classifies one worker's exit from its exit code, error file and captured stderr."""
    base = {"rank": rank, "local_rank": local_rank, "pid": pid, "exitcode": exitcode}
    signum = -exitcode if exitcode < 0 else (exitcode - 128 if 128 < exitcode < 160 else None)
    sig = None
    if signum is not None:
        with contextlib.suppress(ValueError):
            sig = signal.Signals(signum)

    def from_exception(source: str, info: ExceptionInfo) -> FailureRecord:
        return FailureRecord(
            **base,
            failure_class=classify_exception(info),
            signal=sig.name if sig is not None else None,
            exception=info.type_name,
            message=info.message[:500],
            location=info.location,
            source=source,
            user_frame=info.user_frame,
        )

    # An error file is written only by an exception that left the entrypoint: it is the cause
    # even when the process then died of a signal while shutting down.
    recorded = read_error_file(error_file)
    if recorded is not None:
        return from_exception("error_file", recorded)
    stderr_text = read_tail(stderr_file)
    if sig is not None:
        if sig is signal.SIGABRT and (aborted := uncaught_then_aborted(stderr_text)):
            return from_exception("stderr", aborted)
        if sig in _STOP_SIGNALS:
            return FailureRecord(**base, failure_class=FailureClass.STOP_REQUESTED,
                                 signal=sig.name)
        if sig in _CRASH_SIGNALS or exitcode < 0:
            return FailureRecord(**base, failure_class=FailureClass.SIGNAL_CRASH,
                                 signal=sig.name)
    info = parse_traceback(stderr_text)
    if info is not None:
        return from_exception("stderr", info)
    return FailureRecord(**base, failure_class=FailureClass.UNKNOWN)


LEAVING_WINDOW_S = 10.0
"""How recent a worker's last stderr write must be, before its peer's failure was seen, for the
exception it ends with to be the one it is leaving on (:func:`own_exception_at_exit`): a
worker's exit after its traceback takes seconds; a traceback a script printed and went on
from, long before, is no cause of this failure."""


def own_exception_at_exit(rank: int, local_rank: int, pid: int, exitcode: int,
                          stderr_file: str | Path | None, seen_at: float
                          ) -> FailureRecord | None:
    """The failure of a worker that the agent stops, or is about to stop, because a peer failed
    (``seen_at``: when, by the wall clock), when its captured stderr already ends with an
    uncaught exception of its own, written within :data:`LEAVING_WINDOW_S` before: it was
    leaving because of that exception, only more slowly than its peers reported it (a peer's
    collective fails with "connection closed" the moment the worker closes its group, while its
    own exit may take seconds: memory to free, threads to join). None when there is no such
    exception, or when it is a communication error (the echo of another rank) or a stop.

    ``exitcode``: the one it exited with (the agent's stop signal), or, for a worker still
    running, 1, what Python exits with after an uncaught exception."""
    try:
        written = Path(stderr_file).stat().st_mtime if stderr_file else None
    except OSError:
        written = None
    if written is None or written < seen_at - LEAVING_WINDOW_S:
        return None
    info = uncaught_then_aborted(read_tail(stderr_file))
    if info is None or classify_exception(info) in (FailureClass.INFRASTRUCTURE,
                                                    FailureClass.STOP_REQUESTED):
        return None
    return FailureRecord(rank=rank, local_rank=local_rank, pid=pid, exitcode=exitcode,
                         failure_class=classify_exception(info), exception=info.type_name,
                         message=info.message[:500], location=info.location, source="stderr",
                         user_frame=info.user_frame)


def without_collateral(records: tuple[FailureRecord, ...]) -> tuple[FailureRecord, ...]:
    """Drops workers the agent itself stopped (SIGTERM) after another worker failed first.

    torch closes the surviving workers as soon as one fails and reports them as failed too; they
    are consequences, not causes. When every worker was stopped by a signal, they all stay.
    """
    causes = tuple(r for r in records if r.failure_class is not FailureClass.STOP_REQUESTED)
    return causes or records


def peer_failure(error: BaseException) -> bool:
    """Whether ``error`` is the communication layer's report of a failed peer or link, which
    a regroup repairs (pure): the one judge of "a peer failed", for the workers
    (:mod:`elasticft.inprocess.worker`) as for the agent.

    An infrastructure error by :func:`classify_exception` (torch's ``DistError`` family,
    connection errors, gloo's and NCCL's messages), anywhere in the chain of causes, unless one
    of them leaves the process unusable (:func:`process_unusable`).
    """
    seen: set[int] = set()
    current: BaseException | None = error
    found = False
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        message = str(current)
        if process_unusable(f"{type(current).__name__} {message}"):
            return False
        if any(classify_exception(ExceptionInfo(cls.__name__, message, None))
               is FailureClass.INFRASTRUCTURE for cls in type(current).__mro__):
            found = True
        current = current.__cause__ or current.__context__
    return found
