"""Failure classification: what kind of failure a dead worker had, from the evidence it left.

Evidence comes from three places, best first: torch's error file (written by ``@record``), the
last Python traceback in the worker's captured stderr, and the exit code or signal. The class
decides what the policy may do: an infrastructure fault is worth a restart, a bug in the user's
code is not (restarting it only fails again and hides the bug).
"""

from __future__ import annotations

import dataclasses
import enum
import json
import re
import signal
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
    }
)
INFRA_PATTERN = re.compile(
    r"gloo|nccl|cuda|cudnn|cublas|connection (reset|refused|closed|timed out)|"
    r"broken pipe|connectFullMesh|timed out waiting|socket timeout|ecc error|"
    r"device-side assert|unhandled system error|peer closed|TCPStore|DistStore",
    re.IGNORECASE,
)
_EXC_LINE = re.compile(r"^(?P<type>[A-Za-z_][\w.]*(Error|Exception|Interrupt|Exit|Warning)|"
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

    def summary(self) -> str:
        exit_text = f"signal {self.signal}" if self.signal else f"exit {self.exitcode}"
        what = self.exception or exit_text
        if self.message:
            what += f": {self.message}"
        where = f" at {self.location}" if self.location else ""
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


def parse_traceback(text: str) -> ExceptionInfo | None:
    """The last exception of the last Python traceback in ``text`` (a stderr log or callstack)."""
    lines = [line.rstrip("\n") for line in text.splitlines()]
    start = None
    for i in range(len(lines) - 1, -1, -1):
        if lines[i].startswith("Traceback (most recent call last)") or lines[i].endswith(
            "Traceback (most recent call last):"
        ):
            start = i
            break
    if start is None:
        return None
    location = None
    for i in range(start + 1, len(lines)):
        body = _strip_prefix(lines[i])
        frame = _FRAME_LINE.match(body)
        if frame:
            location = f"{frame['file']}:{frame['line']} in {frame['func']}"
            continue
        if body.startswith((" ", "\t")) or not body:
            continue
        match = _EXC_LINE.match(body)
        if match:
            type_name = match["type"].rsplit(".", 1)[-1]
            return ExceptionInfo(type_name, (match["msg"] or "").strip(), location)
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
    if info.type_name in INFRA_EXCEPTIONS or INFRA_PATTERN.search(info.message):
        return FailureClass.INFRASTRUCTURE
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
    if signum is not None:
        try:
            sig = signal.Signals(signum)
        except ValueError:
            sig = None
        if sig is not None:
            if sig in _STOP_SIGNALS:
                return FailureRecord(**base, failure_class=FailureClass.STOP_REQUESTED,
                                     signal=sig.name)
            if sig in _CRASH_SIGNALS or exitcode < 0:
                return FailureRecord(**base, failure_class=FailureClass.SIGNAL_CRASH,
                                     signal=sig.name)
    for source, info in (
        ("error_file", read_error_file(error_file)),
        ("stderr", parse_traceback(read_tail(stderr_file))),
    ):
        if info is not None:
            return FailureRecord(
                **base,
                failure_class=classify_exception(info),
                exception=info.type_name,
                message=info.message[:500],
                location=info.location,
                source=source,
            )
    return FailureRecord(**base, failure_class=FailureClass.UNKNOWN)
