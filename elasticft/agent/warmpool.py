"""Warm start: restarted workers begin in interpreters that have already imported torch.

On a small job most of a restart is Python start-up: ``import torch`` takes about 2.5 s here and
the first ``DistributedDataParallel`` pulls in ``torch._dynamo`` for another 2 s, per worker, on
every restart. The :class:`WarmPool` keeps one pre-started interpreter per local rank that has
already done those imports, and a restart hands the worker's start to it.

How a pre-started interpreter is started and taken over:

* It runs the worker's exact command line (``python -u script.py args...``, torchrun's form) in
  its own session, like torch's workers, with the environment of the attempt that was just
  started, plus a bootstrap directory first on ``PYTHONPATH``. Python runs the bootstrap's
  ``sitecustomize`` at start-up (:mod:`elasticft.agent.warm_bootstrap`): it imports the preload
  modules and waits on a socket, before the script has run.
* At the next start, torch's ``SubprocessHandler`` asks for a process
  (:class:`WarmSubprocessHandler` overrides its ``_popen``); the pool sends the worker's full
  environment, working directory and stdout/stderr descriptors (torch's log files, or the
  agent's own streams) over the socket and returns the interpreter's ``Popen``. The bootstrap
  applies them and returns, and the interpreter runs the script as ``__main__``: ``sys.argv``,
  ``sys.path``, the traceback of an exception and the exit code are Python's own, and the
  process torch watches, signals with ``killpg`` and reaps *is* the worker. There is no proxy
  process, so nothing can be orphaned by killing it.
* An interpreter is used only when nothing that start-up has already consumed differs: the same
  command, working directory and environment except the variables that are bound per attempt
  (ranks, world sizes, master address and port, ``TORCHELASTIC_*``, ``ELASTICFT_*``). Otherwise,
  and on any error, the worker starts cold, exactly as torch would start it.
* After each start the pool is refilled in the background with the environment of that start.

Only binary entrypoints that are a Python interpreter are warm-started; ``--no-python``, NUMA
binding and function entrypoints (where ``--start-method`` applies) start cold. Nothing in the
pre-started interpreter touches CUDA: importing torch does not initialise it.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import select
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading
from collections.abc import Mapping, Sequence
from pathlib import Path
from subprocess import Popen
from typing import Any

from torch.distributed.elastic.multiprocessing.api import SubprocessContext
from torch.distributed.elastic.multiprocessing.subprocess_handler import SubprocessHandler

logger = logging.getLogger(__name__)

FD_ENV = "ELASTICFT_WARM_FD"
PRELOAD_ENV = "ELASTICFT_WARM_PRELOAD"
DEFAULT_PRELOAD = ("torch", "torch._dynamo")
"""torch itself, and what the first DistributedDataParallel or torch.compile imports."""

# Variables a worker gets per attempt. Python and the preloaded imports do not read them at
# start-up, so a pre-started interpreter may take them late; any other difference means cold.
_PER_ATTEMPT_NAMES = frozenset(
    {
        "RANK", "LOCAL_RANK", "GROUP_RANK", "ROLE_RANK", "ROLE_NAME", "WORLD_SIZE",
        "LOCAL_WORLD_SIZE", "GROUP_WORLD_SIZE", "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
    }
)
_PER_ATTEMPT_PREFIXES = ("TORCHELASTIC_", "ELASTICFT_")
_PYTHON_NAME = re.compile(r"python[0-9.]*$")


def bootstrap_dir() -> Path:
    return Path(__file__).resolve().parent / "warm_bootstrap"


def not_warm_startable(argv: Sequence[str], python: str = sys.executable) -> str | None:
    """Why this worker command cannot start in a pre-started interpreter (None: it can).

    Only torchrun's own form, ``<python> -u [-m] target args...``: other interpreter options
    (-E, -I, -S...) could keep Python from running the bootstrap.
    """
    if len(argv) < 3:
        return f"command {list(argv)} is not '<python> -u script ...'"
    executable = argv[0]
    same = False
    with contextlib.suppress(OSError):
        same = os.path.samefile(executable, python)
    if not same and not _PYTHON_NAME.match(os.path.basename(executable)):
        return f"{executable} is not a Python interpreter"
    if argv[1] != "-u":
        return f"interpreter options {argv[1]!r} are not torchrun's '-u'"
    target = argv[3] if argv[2] == "-m" and len(argv) > 3 else argv[2]
    if target.startswith("-"):
        return f"interpreter option {target!r} is not supported in a warm start"
    return None


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


class WarmProcess:
    """One pre-started interpreter waiting for its start request."""

    def __init__(
        self, proc: Popen, channel: socket.socket, argv: tuple[str, ...], env: Mapping[str, str],
        cwd: str,
    ) -> None:
        self.proc = proc
        self.argv = argv
        self.env = dict(env)
        self.cwd = cwd
        self._channel = channel
        self._ready = False

    @classmethod
    def spawn(
        cls, argv: Sequence[str], env: Mapping[str, str], cwd: str, preload: Sequence[str]
    ) -> WarmProcess:
        agent_end, child_end = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        child_env = dict(env)
        path = child_env.get("PYTHONPATH")
        child_env["PYTHONPATH"] = str(bootstrap_dir()) + (os.pathsep + path if path else "")
        child_env[FD_ENV] = str(child_end.fileno())
        child_env[PRELOAD_ENV] = ",".join(preload)
        try:
            # What the warm-up prints (an import warning) goes to a private file first; the
            # bootstrap replays it into the worker's real stdout/stderr when it starts.
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
        return cls(proc, agent_end, tuple(argv), env, cwd)

    def alive(self) -> bool:
        return self.proc.poll() is None

    def ready(self) -> bool:
        """True once the preload imports are done (non-blocking)."""
        if not self._ready:
            readable, _, _ = select.select([self._channel], [], [], 0)
            if readable:
                self._ready = self._channel.recv(1) == b"R"
        return self._ready

    def mismatch(self, argv: Sequence[str], env: Mapping[str, str], cwd: str) -> str | None:
        """Why this interpreter cannot become the worker ``argv``/``env``/``cwd`` (None: it can)."""
        if tuple(str(a) for a in argv) != self.argv:
            return "the command changed"
        if cwd != self.cwd:
            return f"the working directory changed to {cwd}"
        differ = startup_mismatch(self.env, env)
        if differ:
            return "start-up variables changed: " + ", ".join(differ)
        if not self.alive():
            return f"it exited with {self.proc.returncode}"
        return None

    def start(
        self, argv: Sequence[str], env: Mapping[str, str], cwd: str, stdout: int, stderr: int
    ) -> Popen:
        """Hands over the worker's start; the returned ``Popen`` is the worker."""
        payload = json.dumps(
            {"argv": [str(a) for a in argv], "env": dict(env), "cwd": cwd}
        ).encode()
        socket.send_fds(self._channel, [struct.pack("!Q", len(payload))], [stdout, stderr])
        self._channel.sendall(payload)
        self._channel.close()
        return self.proc

    def discard(self) -> None:
        """Ends an interpreter that was never started (it has run no user code)."""
        self._channel.close()
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            logger.warning("pre-started interpreter %d did not exit after SIGKILL", self.proc.pid)


class WarmPool:
    """Pre-started interpreters, one per local rank, refilled after every start."""

    def __init__(
        self, preload: Sequence[str] = DEFAULT_PRELOAD, *, refill_delay_s: float = 0.0
    ) -> None:
        self.preload = tuple(preload)
        self.refill_delay_s = refill_delay_s
        self._lock = threading.Lock()
        self._idle: dict[int, WarmProcess] = {}
        self._timers: list[threading.Timer] = []
        self._closed = False

    def take(
        self, local_rank: int, argv: Sequence[str], env: Mapping[str, str], cwd: str
    ) -> WarmProcess | None:
        """The pre-started interpreter for ``local_rank`` if it can become this worker."""
        with self._lock:
            warm = None if self._closed else self._idle.pop(local_rank, None)
        if warm is None:
            return None
        reason = warm.mismatch(argv, env, cwd)
        if reason is not None:
            logger.info("local rank %d starts cold: %s", local_rank, reason)
            warm.discard()
            return None
        return warm

    def idle(self) -> dict[int, WarmProcess]:
        with self._lock:
            return dict(self._idle)

    def refill(
        self, local_rank: int, argv: Sequence[str], env: Mapping[str, str], cwd: str
    ) -> None:
        """Starts (in the background) the next interpreter for ``local_rank``."""
        timer = threading.Timer(
            self.refill_delay_s, self._spawn, (local_rank, tuple(argv), dict(env), cwd)
        )
        timer.daemon = True
        with self._lock:
            if self._closed:
                return
            self._timers = [t for t in self._timers if t.is_alive()]
            self._timers.append(timer)
        timer.start()

    def _spawn(
        self, local_rank: int, argv: tuple[str, ...], env: dict[str, str], cwd: str
    ) -> None:
        try:
            warm = WarmProcess.spawn(argv, env, cwd, self.preload)
        except Exception:  # the pool is an optimisation: never let it cost the run
            logger.warning("could not pre-start an interpreter for local rank %d", local_rank,
                           exc_info=True)
            return
        with self._lock:
            replaced, closed = self._idle.get(local_rank), self._closed
            if not closed:
                self._idle[local_rank] = warm
        if closed:
            warm.discard()
        elif replaced is not None:
            replaced.discard()

    def close(self) -> None:
        with self._lock:
            self._closed = True
            timers, self._timers = self._timers, []
        for timer in timers:
            timer.cancel()
            if timer.is_alive():
                timer.join(timeout=30)
        with self._lock:
            idle, self._idle = self._idle, {}
        for warm in idle.values():
            warm.discard()


class WarmSubprocessHandler(SubprocessHandler):
    """torch's ``SubprocessHandler`` whose process comes from the pool when it can."""

    def __init__(self, pool: WarmPool, **kwargs: Any) -> None:
        self._pool = pool
        self.warm = False
        self.launch: tuple[tuple[str, ...], dict[str, str], str] | None = None
        super().__init__(**kwargs)

    def _popen(self, args: tuple, env: dict[str, str]) -> Popen:
        argv = tuple(str(a) for a in args)
        cwd = os.getcwd()
        if not_warm_startable(argv) is None:
            self.launch = (argv, dict(env), cwd)
            warm = self._pool.take(self.local_rank_id, argv, env, cwd)
            if warm is not None:
                # torch's handler passes these files (or its own inherited streams) to Popen.
                out = self._stdout.fileno() if self._stdout else sys.__stdout__.fileno()
                err = self._stderr.fileno() if self._stderr else sys.__stderr__.fileno()
                try:
                    proc = warm.start(argv, env, cwd, out, err)
                    self.warm = True
                    return proc
                except OSError:
                    logger.warning("warm start of local rank %d failed; starting cold",
                                   self.local_rank_id, exc_info=True)
                    warm.discard()
        return super()._popen(args, env)


class WarmSubprocessContext(SubprocessContext):
    """torch's ``SubprocessContext`` with :class:`WarmSubprocessHandler` workers."""

    def __init__(self, pool: WarmPool, **kwargs: Any) -> None:
        self._pool = pool
        super().__init__(**kwargs)

    def _start(self) -> None:
        if self.subprocess_handlers:
            raise ValueError("the worker processes were already started")
        self.subprocess_handlers = {
            local_rank: WarmSubprocessHandler(
                self._pool,
                entrypoint=self.entrypoint,
                args=self.args[local_rank],
                env=self.envs[local_rank],
                stdout=self.stdouts[local_rank],
                stderr=self.stderrs[local_rank],
                local_rank_id=local_rank,
                numa_options=self._numa_options,
            )
            for local_rank in range(self.nprocs)
        }
        for local_rank, handler in self.subprocess_handlers.items():
            if handler.launch is not None:
                self._pool.refill(local_rank, *handler.launch)

    def warm_ranks(self) -> list[int]:
        return sorted(r for r, h in self.subprocess_handlers.items() if getattr(h, "warm", False))


class _WorkerEnvsReady(BaseException):
    """Carries the worker environments torch has computed out of its ``_start_workers``.

    A BaseException so that torch's metric decorator does not count it as a failure.
    """

    def __init__(self, envs: dict[int, dict[str, str]]) -> None:
        super().__init__("worker environments ready")
        self.envs = envs


class WarmStartMixin:
    """Mixed into the agent (before ``LocalElasticAgent``): starts workers through the pool.

    torch's ``LocalElasticAgent._start_workers`` computes every worker's environment (torch's
    variables, ``_set_local_rank_env``, OMP_NUM_THREADS) and then calls ``start_processes``. To
    keep that computation torch's own, the mixin runs it and takes the environments from the
    ``_setup_local_watchdog(envs)`` hook it calls just before starting processes; it then starts
    them with :class:`WarmSubprocessContext` instead of torch's ``SubprocessContext``.
    """

    warm_pool: WarmPool | None = None
    warm_ranks: tuple[int, ...] = ()
    """Local ranks of the latest start that began in a pre-started interpreter."""
    _capturing_worker_envs = False

    def _setup_local_watchdog(self, envs: dict[int, dict[str, str]]) -> None:
        if self._capturing_worker_envs:
            raise _WorkerEnvsReady(envs)
        super()._setup_local_watchdog(envs)  # type: ignore[misc]

    def _start_workers(self, worker_group: Any) -> dict[int, Any]:
        from torch.distributed.elastic.utils import macros

        self.warm_ranks = ()
        spec = worker_group.spec
        if (
            self.warm_pool is None
            or not isinstance(spec.entrypoint, str)
            or spec.numa_options is not None
        ):
            return super()._start_workers(worker_group)  # type: ignore[misc]
        self._capturing_worker_envs = True
        try:
            pids = super()._start_workers(worker_group)  # type: ignore[misc]
        except _WorkerEnvsReady as ready:
            envs = ready.envs
        else:
            logger.warning("torch started the workers without the watchdog hook; warm start off")
            self.warm_pool = None
            return pids
        finally:
            self._capturing_worker_envs = False
        super()._setup_local_watchdog(envs)  # type: ignore[misc]
        self._setup_healthcheck()  # type: ignore[attr-defined]
        args = {
            w.local_rank: tuple(macros.substitute(list(spec.args), str(w.local_rank)))
            for w in worker_group.workers
        }
        template = self._log_line_prefix_template  # type: ignore[attr-defined]
        prefixes = None
        if template:
            from string import Template

            prefixes = {
                w.local_rank: Template(template).safe_substitute(
                    role_name=spec.role, rank=w.global_rank, local_rank=w.local_rank
                )
                for w in worker_group.workers
            }
        context = WarmSubprocessContext(
            self.warm_pool,
            name=spec.role,
            entrypoint=spec.entrypoint,
            args=args,
            envs=envs,
            logs_specs=self._logs_specs,  # type: ignore[attr-defined]
            log_line_prefixes=prefixes,
            numa_options=None,
            duplicate_stdout_filters=spec.duplicate_stdout_filters,
            duplicate_stderr_filters=spec.duplicate_stderr_filters,
        )
        try:
            context.start()
        except Exception:
            context.close()
            raise
        self._pcontext = context
        self.warm_ranks = tuple(context.warm_ranks())
        return context.pids()
