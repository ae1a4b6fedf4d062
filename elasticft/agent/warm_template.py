"""The warm template, the agent's side: one interpreter that has imported torch and forks workers.

The agent starts ``python -u script.py args...`` (a worker's exact command line) with the warm
bootstrap first on ``PYTHONPATH`` (:mod:`elasticft.agent.warm_bootstrap`): it imports the
preload modules once and then serves start requests on a socket, for every local rank of the
node whose start-up it matches. :class:`WarmInterpreter` is the agent's handle on it: it sends a
request (the worker's full environment, working directory, signal dispositions and its
stdout/stderr descriptors), and the reply is the pid of the forked worker, which by then is the
agent's own child (the subreaper trick, :class:`elasticft.procs.AdoptedWorker`).

The template serves one request at a time, in the order they arrive: each is a fork of a few
milliseconds. A caller that cannot have the template within :data:`BUSY_TIMEOUT_S` (another
start is stuck in it) gets :class:`TemplateBusy` and starts its worker cold, the template kept;
a template that does not answer a request at all is ended by the pool
(:mod:`elasticft.agent.warmpool`), every local rank then starting cold until a new one is ready.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import select
import signal
import socket
import struct
import subprocess
import tempfile
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from subprocess import Popen

from elasticft.addon.api import prepend_paths
from elasticft.procs import AdoptedWorker, adopting_orphans

logger = logging.getLogger(__name__)

FD_ENV = "ELASTICFT_WARM_FD"
PRELOAD_ENV = "ELASTICFT_WARM_PRELOAD"
DEVICE_ENV = "ELASTICFT_WARM_DEVICE"
BUSY_TIMEOUT_S = 10.0
"""How long a start waits for the template while another start is in it, before going cold."""
REPLY_TIMEOUT_S = 60.0
"""How long a start waits for the template's reply (the forked worker's pid)."""

# Variables a worker gets per attempt. Python and the preloaded imports do not read them at
# start-up, so a pre-started interpreter may take them late; any other difference means cold.
_PER_ATTEMPT_NAMES = frozenset(
    {
        "RANK", "LOCAL_RANK", "GROUP_RANK", "ROLE_RANK", "ROLE_NAME", "WORLD_SIZE",
        "LOCAL_WORLD_SIZE", "GROUP_WORLD_SIZE", "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
    }
)
_PER_ATTEMPT_PREFIXES = ("TORCHELASTIC_", "ELASTICFT_")


class TemplateBusy(OSError):
    """Another start held the template for longer than :data:`BUSY_TIMEOUT_S`."""


def bootstrap_dir() -> Path:
    return Path(__file__).resolve().parent / "warm_bootstrap"


def start_signals() -> dict[str, bool]:
    """Whether this process ignores each signal a worker's start inherits: a worker started cold
    keeps exactly the ignored ones, every other is reset to its default at ``exec``. The warm
    interpreter started earlier, maybe while the agent ignored more (``nohup``, a job in the
    background), so its worker is given these dispositions."""
    return {name: signal.getsignal(getattr(signal, name)) is signal.SIG_IGN
            for name in ("SIGINT", "SIGTERM", "SIGHUP", "SIGQUIT", "SIGUSR1", "SIGUSR2")}


def startup_mismatch(started: Mapping[str, str], requested: Mapping[str, str]) -> list[str]:
    """Variables that differ between the pre-started interpreter's start-up environment and the
    worker's, other than the per-attempt ones (pure)."""
    return sorted(
        name
        for name in started.keys() | requested.keys()
        if started.get(name) != requested.get(name)
        and name not in _PER_ATTEMPT_NAMES
        and not name.startswith(_PER_ATTEMPT_PREFIXES)
    )


def launch_mismatch(
    started: tuple[tuple[str, ...], Mapping[str, str], str],
    argv: Sequence[str], env: Mapping[str, str], cwd: str,
) -> str | None:
    """Why an interpreter started as ``started`` (command, environment, directory) cannot become
    the worker ``argv``/``env``/``cwd`` (None: it can; pure)."""
    started_argv, started_env, started_cwd = started
    if tuple(str(a) for a in argv) != started_argv:
        return "the command changed"
    if cwd != started_cwd:
        return f"the working directory changed to {cwd}"
    differ = startup_mismatch(started_env, env)
    if differ:
        return "start-up variables changed: " + ", ".join(differ)
    return None


class WarmInterpreter:
    """One interpreter with the preload imports done, forking a worker per start request, for
    any local rank whose start-up it matches."""

    def __init__(
        self, proc: Popen, channel: socket.socket, argv: tuple[str, ...], env: Mapping[str, str],
        cwd: str,
    ) -> None:
        self.proc = proc
        self.argv = argv
        self.env = dict(env)
        self.cwd = cwd
        self.starts = 0
        self._channel = channel
        self._ready = False
        self._ready_lock = threading.Lock()
        self._lock = threading.Lock()  # one start request at a time

    @classmethod
    def spawn(
        cls, argv: Sequence[str], env: Mapping[str, str], cwd: str, preload: Sequence[str],
        device: str = "off",
    ) -> WarmInterpreter:
        """``device``: ``auto``/``always`` fork a spare after each start that prepares the
        device of the started worker's local rank (see the bootstrap's
        ``_elasticft_warm_device``); ``off``: none."""
        agent_end, child_end = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        child_env = dict(env)
        if device != "off":
            child_env[DEVICE_ENV] = device
        child_env["PYTHONPATH"] = prepend_paths([bootstrap_dir()], child_env.get("PYTHONPATH"))
        child_env[FD_ENV] = str(child_end.fileno())
        child_env[PRELOAD_ENV] = ",".join(preload)
        try:
            # What the warm-up prints (an import warning) goes to a private file first; each
            # forked worker replays it into its real stdout/stderr when it starts.
            with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
                proc = Popen(
                    list(argv), env=child_env, cwd=cwd, stdout=out, stderr=err,
                    pass_fds=(child_end.fileno(),), start_new_session=True,
                )
        except BaseException:
            agent_end.close()
            raise
        finally:
            child_end.close()
        return cls(proc, agent_end, tuple(str(a) for a in argv), env, cwd)

    def alive(self) -> bool:
        return self.proc.poll() is None

    def ready(self, timeout: float = 0.0) -> bool:
        """True once the preload imports are done (waits up to ``timeout`` seconds; every local
        rank's start may wait at once, and a caller with no time to wait is not held up by
        them)."""
        deadline = time.monotonic() + timeout
        if not self._ready_lock.acquire(timeout=timeout):
            return self._ready
        try:
            if not self._ready:
                left = max(deadline - time.monotonic(), 0.0)
                readable, _, _ = select.select([self._channel], [], [], left)
                if readable:
                    self._ready = self._channel.recv(1) == b"R"
            return self._ready
        finally:
            self._ready_lock.release()

    def mismatch(self, argv: Sequence[str], env: Mapping[str, str], cwd: str) -> str | None:
        """Why this interpreter cannot become the worker ``argv``/``env``/``cwd`` (None: it can)."""
        reason = launch_mismatch((self.argv, self.env, self.cwd), argv, env, cwd)
        if reason is None and not self.alive():
            return f"it exited with {self.proc.returncode}"
        return reason

    def start(
        self, argv: Sequence[str], env: Mapping[str, str], cwd: str, stdout: int, stderr: int,
        *, ready_timeout: float = 120.0,
    ) -> Popen:
        """Forks the worker; the returned ``Popen`` is the worker, a child of this process.

        Waits for the imports first if they are still running (a restart soon after the
        previous start); raises :class:`TemplateBusy` if another start keeps the template
        (the worker is to be started cold, the template kept) and ``OSError`` if the
        interpreter cannot deliver the worker (it is to be ended, the worker started cold).
        """
        if not self.ready(ready_timeout):
            raise OSError(f"warm interpreter {self.proc.pid} not ready after {ready_timeout} s")
        payload = json.dumps(
            {"argv": [str(a) for a in argv], "env": dict(env), "cwd": cwd,
             "signals": start_signals()}
        ).encode()
        if not self._lock.acquire(timeout=BUSY_TIMEOUT_S):
            raise TemplateBusy(f"warm interpreter {self.proc.pid} busy for {BUSY_TIMEOUT_S} s")
        try:
            with adopting_orphans():
                socket.send_fds(self._channel, [struct.pack("!Q", len(payload))],
                                [stdout, stderr])
                self._channel.sendall(payload)
                pid = self._read_pid(timeout=REPLY_TIMEOUT_S)
            if pid > 0:
                self.starts += 1
        finally:
            self._lock.release()
        if pid <= 0:
            raise OSError(f"warm interpreter {self.proc.pid} could not fork the worker")
        return AdoptedWorker(pid, argv)

    def _read_pid(self, timeout: float) -> int:
        reply = b""
        deadline = time.monotonic() + timeout
        while len(reply) < 9:
            left = deadline - time.monotonic()
            readable, _, _ = select.select([self._channel], [], [], max(left, 0.0))
            chunk = self._channel.recv(9 - len(reply)) if readable else b""
            if not chunk:
                return -1  # the interpreter exited, or did not answer in time
            reply += chunk
        if reply[:1] != b"P":
            return -1
        return int(struct.unpack("!q", reply[1:])[0])

    def discard(self) -> None:
        """Ends the interpreter (it has run no user code; its forked workers are not touched)."""
        self._channel.close()
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            logger.warning("warm interpreter %d did not exit after SIGKILL", self.proc.pid)
