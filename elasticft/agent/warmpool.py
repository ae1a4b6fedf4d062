"""Warm start: restarted workers are forked from interpreters that have already imported torch.

On a small job most of a restart is Python start-up: ``import torch`` takes about 2.5 s here and
the first ``DistributedDataParallel`` pulls in ``torch._dynamo`` for another 2 s, per worker, on
every restart. The :class:`WarmPool` keeps one warm interpreter per local rank that has done
those imports once; every later start of that local rank is a fork of it, in milliseconds, and
nothing is re-imported after a failure to compete with the resumed training for the CPU.

How a warm interpreter is started and how a worker is forked from it:

* It runs the worker's exact command line (``python -u script.py args...``, torchrun's form)
  in its own session, like torch's workers, with the environment of the attempt that was just
  started, plus a bootstrap directory first on ``PYTHONPATH``. Python runs the bootstrap's
  ``sitecustomize`` at start-up (:mod:`elasticft.agent.warm_bootstrap`): it imports the preload
  modules and serves start requests on a socket, before the script has run.
* At the next start, torch's ``SubprocessHandler`` asks for a process
  (:class:`WarmSubprocessHandler` overrides its ``_popen``); the pool sends the worker's full
  environment, working directory and stdout/stderr descriptors (torch's log files, or the
  agent's own streams) over the socket. The interpreter forks; the child applies them and
  returns from start-up, and runs the script as ``__main__``: ``sys.argv``, ``sys.path``, the
  traceback of an exception and the exit code are Python's own.
* The child is forked through an intermediate process that exits at once, while the agent holds
  Linux's child-subreaper flag, so the worker becomes the agent's own child: the ``Popen`` torch
  watches, signals with ``killpg`` and reaps *is* the worker
  (:class:`elasticft.procs.AdoptedWorker`). There is no proxy process, so nothing can be
  orphaned by killing it.
* An interpreter is used only when nothing that start-up has already consumed differs: the same
  command, working directory and environment except the variables that are bound per attempt
  (ranks, world sizes, master address and port, ``TORCHELASTIC_*``, ``ELASTICFT_*``). Otherwise,
  and on any error, the worker starts cold, exactly as torch would start it, and a new warm
  interpreter is started in the background with the environment of that start.

Only binary entrypoints that are a Python interpreter are warm-started; ``--no-python``, NUMA
binding and function entrypoints (where ``--start-method`` applies) start cold. Nothing in the
warm interpreter touches CUDA or starts a thread pool: importing torch does neither, so forking
it is as safe as a DataLoader's fork. On a machine with NVIDIA GPUs it forks, after each start,
that local rank's next worker early, which makes its CUDA context once the running worker has
exited (:mod:`elasticft.agent.warm_bootstrap._elasticft_warm_device`): a restarted GPU worker
finds CUDA initialised on its device, and no GPU memory is held while a worker runs. A forked
worker reseeds numpy's global generator, as a cold start would (Python's ``random`` reseeds
itself on fork).
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
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from subprocess import Popen
from typing import Any

from elasticft import torch_compat
from elasticft.addon.api import prepend_paths
from elasticft.agent import lifeline
from elasticft.agent.console import gate_tracebacks
from elasticft.procs import AdoptedWorker, adopting_orphans
from elasticft.torch_compat import SubprocessContext, SubprocessHandler

logger = logging.getLogger(__name__)

FD_ENV = "ELASTICFT_WARM_FD"
PRELOAD_ENV = "ELASTICFT_WARM_PRELOAD"
DEFAULT_PRELOAD = ("torch", "torch._dynamo")
"""torch itself, and what the first DistributedDataParallel or torch.compile imports."""
DEVICE_ENV = "ELASTICFT_WARM_DEVICE"
NCCL_ERROR_HANDLING = "TORCH_NCCL_ASYNC_ERROR_HANDLING"


def default_device_mode(nvidia_control: str = "/dev/nvidiactl") -> str:
    """``auto`` (spares that prepare the GPU of a worker that used one) where the NVIDIA driver
    is, else ``off`` (no spares). The agent must not ask CUDA itself: that would initialise it."""
    return "auto" if os.path.exists(nvidia_control) else "off"

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


class WarmInterpreter:
    """One interpreter with the preload imports done, forking a worker per start request."""

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
        self._lock = threading.Lock()

    @classmethod
    def spawn(
        cls, argv: Sequence[str], env: Mapping[str, str], cwd: str, preload: Sequence[str],
        device: str = "off",
    ) -> WarmInterpreter:
        """``device``: ``auto``/``always`` fork a spare after each start that prepares the
        device (see the bootstrap's ``_elasticft_warm_device``); ``off``: none."""
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
        return cls(proc, agent_end, tuple(argv), env, cwd)

    def alive(self) -> bool:
        return self.proc.poll() is None

    def ready(self, timeout: float = 0.0) -> bool:
        """True once the preload imports are done (waits up to ``timeout`` seconds)."""
        with self._lock:
            if not self._ready:
                readable, _, _ = select.select([self._channel], [], [], timeout)
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
        self, argv: Sequence[str], env: Mapping[str, str], cwd: str, stdout: int, stderr: int,
        *, ready_timeout: float = 120.0,
    ) -> Popen:
        """Forks the worker; the returned ``Popen`` is the worker, a child of this process.

        Waits for the imports first if they are still running (a restart soon after the
        previous start); raises ``OSError`` if the interpreter cannot deliver the worker, which
        then is to be started cold.
        """
        if not self.ready(ready_timeout):
            raise OSError(f"warm interpreter {self.proc.pid} not ready after {ready_timeout} s")
        payload = json.dumps(
            {"argv": [str(a) for a in argv], "env": dict(env), "cwd": cwd,
             "signals": start_signals()}
        ).encode()
        with self._lock, adopting_orphans():
            socket.send_fds(self._channel, [struct.pack("!Q", len(payload))], [stdout, stderr])
            self._channel.sendall(payload)
            pid = self._read_pid(timeout=60.0)
        if pid <= 0:
            raise OSError(f"warm interpreter {self.proc.pid} could not fork the worker")
        self.starts += 1
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


class WarmPool:
    """Warm interpreters, one per local rank, each forking that local rank's workers."""

    def __init__(self, preload: Sequence[str] = DEFAULT_PRELOAD, device: str | None = None
                 ) -> None:
        self.preload = tuple(preload)
        self.device = default_device_mode() if device is None else device
        self._lock = threading.Lock()
        self._interpreters: dict[int, WarmInterpreter] = {}
        self._spawning: dict[int, threading.Thread] = {}
        self._closed = False

    def take(
        self, local_rank: int, argv: Sequence[str], env: Mapping[str, str], cwd: str
    ) -> WarmInterpreter | None:
        """The warm interpreter of ``local_rank`` if it can fork this worker; one that cannot
        is ended (the next :meth:`refill` starts a new one)."""
        with self._lock:
            spawning = self._spawning.get(local_rank)
        if spawning is not None:
            spawning.join(timeout=60)  # starting the interpreter's process takes milliseconds
        with self._lock:
            warm = None if self._closed else self._interpreters.get(local_rank)
        if warm is None:
            return None
        reason = warm.mismatch(argv, env, cwd)
        if reason is not None:
            logger.info("local rank %d starts cold: %s", local_rank, reason)
            self.drop(local_rank, warm)
            return None
        return warm

    def drop(self, local_rank: int, warm: WarmInterpreter) -> None:
        """Ends ``warm`` and forgets it (it failed to start a worker)."""
        with self._lock:
            if self._interpreters.get(local_rank) is warm:
                del self._interpreters[local_rank]
        warm.discard()

    def interpreters(self) -> dict[int, WarmInterpreter]:
        with self._lock:
            return dict(self._interpreters)

    def prepare(
        self, local_rank: int, argv: Sequence[str], env: Mapping[str, str], cwd: str
    ) -> None:
        """Makes sure an interpreter that can fork this worker exists or is being started."""
        if self.take(local_rank, argv, env, cwd) is None:
            self.refill(local_rank, argv, env, cwd)

    def refill(
        self, local_rank: int, argv: Sequence[str], env: Mapping[str, str], cwd: str
    ) -> None:
        """Starts (in the background) a warm interpreter for ``local_rank`` if it has none."""
        with self._lock:
            if self._closed or local_rank in self._interpreters or (
                local_rank in self._spawning and self._spawning[local_rank].is_alive()
            ):
                return
            thread = threading.Thread(
                target=self._spawn, args=(local_rank, tuple(argv), dict(env), cwd),
                name=f"elasticft-warm-{local_rank}", daemon=True,
            )
            self._spawning[local_rank] = thread
        thread.start()

    def _spawn(
        self, local_rank: int, argv: tuple[str, ...], env: dict[str, str], cwd: str
    ) -> None:
        try:
            warm = WarmInterpreter.spawn(argv, env, cwd, self.preload, self.device)
        except Exception:  # the pool is an optimisation: never let it cost the run
            logger.warning("could not start a warm interpreter for local rank %d", local_rank,
                           exc_info=True)
            return
        with self._lock:
            replaced, closed = self._interpreters.get(local_rank), self._closed
            if not closed:
                self._interpreters[local_rank] = warm
        if closed:
            warm.discard()
        elif replaced is not None:
            replaced.discard()

    def close(self) -> None:
        with self._lock:
            self._closed = True
            spawning, self._spawning = list(self._spawning.values()), {}
        for thread in spawning:
            thread.join(timeout=30)
        with self._lock:
            interpreters, self._interpreters = self._interpreters, {}
        for warm in interpreters.values():
            warm.discard()


class WarmSubprocessHandler(SubprocessHandler):
    """torch's ``SubprocessHandler`` whose process comes from the pool when it can."""

    def __init__(self, pool: WarmPool | None, **kwargs: Any) -> None:
        self._pool = pool
        self.warm = False
        self.launch: tuple[tuple[str, ...], dict[str, str], str] | None = None
        super().__init__(**kwargs)

    def _popen(self, args: tuple, env: dict[str, str]) -> Popen:
        argv = tuple(str(a) for a in args)
        cwd = os.getcwd()
        if self._pool is not None and not_warm_startable(argv) is None:
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
                    self._pool.drop(self.local_rank_id, warm)
        # torch's own start, the worker bound to this agent (elasticft.agent.lifeline).
        return Popen(args=args, env=env, stdout=self._stdout, stderr=self._stderr,
                     start_new_session=True, preexec_fn=lifeline.cold_preexec())


class WarmSubprocessContext(SubprocessContext):
    """torch's ``SubprocessContext`` with :class:`WarmSubprocessHandler` workers."""

    def __init__(self, pool: WarmPool | None, **kwargs: Any) -> None:
        self._pool = pool
        super().__init__(**kwargs)
        gate_tracebacks(self)  # a recovered failure's tracebacks stay in the worker logs

    def _start(self) -> None:
        if self.subprocess_handlers:
            raise ValueError("the worker processes were already started")
        if self._pool is not None and torch_compat.numa_options_of(self) is None:
            # Every local rank's interpreter does its imports at the same time (the first
            # start, or after a change of environment); each worker is then forked from it.
            cwd = os.getcwd()
            for local_rank in range(self.nprocs):
                argv = (self.entrypoint, *[str(a) for a in self.args[local_rank]])
                if not_warm_startable(argv) is None:
                    env = {**os.environ, **self.envs[local_rank]}
                    self._pool.prepare(local_rank, argv, env, cwd)
        self.subprocess_handlers = {
            local_rank: WarmSubprocessHandler(
                self._pool,
                **torch_compat.subprocess_handler_kwargs(
                    entrypoint=self.entrypoint,
                    args=self.args[local_rank],
                    env=self.envs[local_rank],
                    stdout=self.stdouts[local_rank],
                    stderr=self.stderrs[local_rank],
                    local_rank_id=local_rank,
                    numa_options=torch_compat.numa_options_of(self),
                ),
            )
            for local_rank in range(self.nprocs)
        }
        for local_rank, handler in self.subprocess_handlers.items():
            if self._pool is not None and handler.launch is not None:
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

    def worker_pythonpath(self, existing: str | None) -> str | None:
        """The workers' ``PYTHONPATH`` as the agent composes it (None: ``existing`` stands)."""
        raise NotImplementedError

    def startup_env(self) -> dict[str, str]:
        """Variables the agent adds to every worker's environment that its start-up may read
        (the NCCL settings of in-process recovery): a warm interpreter starts with them."""
        raise NotImplementedError

    def prewarm(self, spec: Any) -> None:
        """Starts the warm interpreters before the first rendezvous, so that their imports
        overlap the wait (all of it for a standby, whose workers then start as fast as a
        survivor's). The environment is the one the workers most likely get: this process's,
        plus what torch adds and the ``PYTHONPATH`` the collaborators declare; a worker whose
        environment differs starts cold, as before."""
        if (self.warm_pool is None or not isinstance(spec.entrypoint, str)
                or spec.numa_options is not None or torch_compat.warm_start_unavailable()):
            return
        # torch's LocalElasticAgent gives every worker TORCH_NCCL_ASYNC_ERROR_HANDLING (the
        # agent's, else 1); startup_env overrides it on a GPU node. Without it here, every first
        # start found a mismatch and imported torch again in a second interpreter.
        env = {**os.environ, NCCL_ERROR_HANDLING: os.environ.get(NCCL_ERROR_HANDLING, "1"),
               **self.startup_env()}
        if (path := self.worker_pythonpath(os.environ.get("PYTHONPATH"))) is not None:
            env["PYTHONPATH"] = path
        for local_rank in range(spec.local_world_size):
            args = torch_compat.macros.substitute(list(spec.args), str(local_rank))
            argv = (spec.entrypoint, *[str(a) for a in args])
            if not_warm_startable(argv) is None:
                self.warm_pool.refill(local_rank, argv, env, os.getcwd())

    def _setup_local_watchdog(self, envs: dict[int, dict[str, str]]) -> None:
        if self._capturing_worker_envs:
            raise _WorkerEnvsReady(envs)
        super()._setup_local_watchdog(envs)  # type: ignore[misc]

    def _start_workers(self, worker_group: Any) -> dict[int, Any]:
        macros = torch_compat.macros
        self.warm_ranks = ()
        spec = worker_group.spec
        if self.warm_pool is not None and (missing := torch_compat.warm_start_unavailable()):
            torch_compat.degraded("warm start", f"torch lacks {missing}")
            self.warm_pool = None
        # Without a pool the workers start cold, through the same context: bound to the agent.
        if (
            torch_compat.warm_start_unavailable()
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
            prefixes = {
                w.local_rank: torch_compat.log_line_prefix(
                    template, spec.role, w.global_rank, w.local_rank)
                for w in worker_group.workers
            }
        context = WarmSubprocessContext(
            self.warm_pool,
            **torch_compat.subprocess_context_kwargs(
                name=spec.role,
                entrypoint=spec.entrypoint,
                args=args,
                envs=envs,
                logs_specs=self._logs_specs,  # type: ignore[attr-defined]
                log_line_prefixes=prefixes,
                numa_options=None,
                duplicate_stdout_filters=getattr(spec, "duplicate_stdout_filters", None),
                duplicate_stderr_filters=getattr(spec, "duplicate_stderr_filters", None),
            ),
        )
        try:
            context.start()
        except Exception:
            context.close()
            raise
        self._pcontext = context
        self.warm_ranks = tuple(context.warm_ranks())
        return context.pids()
