"""A worker's lifeline: every worker dies with the agent that started it.

torch starts each worker in a session of its own, so that the agent can signal a worker and
everything it started with one ``killpg``. The price is that nothing ties a worker to its agent:
when the agent dies without stopping them (SIGKILL, the OOM killer, a crashed launcher), the
workers are re-parented to init and train on, unsupervised, with no diagnostics and no
checkpoint service, holding their memory (and GPU memory), and a restarted agent meets them.

The tie is Linux's parent-death signal (``prctl(PR_SET_PDEATHSIG, SIGKILL)``): the kernel kills
the worker when its parent dies. Three details make it hold:

* **The parent is a thread.** The signal fires when the thread that is the worker's parent
  exits, not the process. A cold worker's parent is the thread that ran ``Popen``: the agent's
  run loop, its main thread. A worker started from any other thread is not bound (that thread
  ending would kill it); :func:`cold_preexec` answers None there. A warm-forked worker is
  re-parented to the agent by the child-subreaper flag, and the kernel picks the agent's first
  live thread, its main thread, as the new parent.
* **The agent may die between the fork and the call.** The child sets the signal, then checks
  ``getppid()``: if its parent is no longer the agent, the agent is gone and it exits at once.
* **A warm-forked worker binds itself after the re-parenting** (in the warm bootstrap): before
  that its parent is the intermediate process of the double fork, which exits at once.

The signal binds the worker itself; what the worker starts (DataLoader workers) is bound to the
worker by its own means, and goes with the worker's session when the agent ends it.

A worker carries its agent's pid (``ELASTICFT_AGENT_PID``). At start an agent ends the **strays**
of its job on its host: processes of this user whose environment names this job and an agent
pid that is not their parent and is gone (an agent killed before its workers were bound). It
says so in one line (:func:`end_strays`).
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import signal
import threading
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path

from elasticft import procs

logger = logging.getLogger(__name__)

AGENT_PID_ENV = "ELASTICFT_AGENT_PID"
"""The pid of the agent that started the worker (set in every worker's environment)."""
RUN_ID_ENV = "TORCHELASTIC_RUN_ID"
PR_SET_PDEATHSIG = 1
"""``prctl`` option (``include/uapi/linux/prctl.h``)."""

_libc = ctypes.CDLL(None, use_errno=True)


def bind_to_parent(parent_pid: int, sig: int = signal.SIGKILL) -> bool:
    """In a child: asks for ``sig`` when the parent thread dies; False when the parent is no
    longer ``parent_pid`` (it died before the call: the caller exits)."""
    if _libc.prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0) != 0:
        return True  # not Linux-capable here: the worker runs unbound, as under torch
    return os.getppid() == parent_pid


def cold_preexec() -> Callable[[], None] | None:
    """The ``preexec_fn`` that binds a cold worker to this process (run in the child between
    fork and exec; the signal survives ``exec``), or None when the caller is not the main
    thread, whose exit alone would not mean the agent's death."""
    if threading.current_thread() is not threading.main_thread():
        return None
    agent = os.getpid()

    def bind() -> None:
        if not bind_to_parent(agent):
            os._exit(1)  # the agent died during the fork; nobody waits for this worker

    return bind


def worker_env() -> dict[str, str]:
    """The variables every worker of this agent gets."""
    return {AGENT_PID_ENV: str(os.getpid())}


def _environ(pid: int) -> dict[str, str]:
    try:
        raw = Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return {}
    pairs = (item.split(b"=", 1) for item in raw.split(b"\0") if b"=" in item)
    return {k.decode(errors="replace"): v.decode(errors="replace") for k, v in pairs}


def _parent(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return None


def is_stray(environ: Mapping[str, str], parent: int | None, run_id: str,
             agent_alive: Callable[[int], bool]) -> bool:
    """Whether a process with ``environ`` and parent pid ``parent`` is a stray worker of job
    ``run_id`` (pure but for ``agent_alive(pid)``): a worker of that job whose agent is not its
    parent and is gone."""
    if environ.get(RUN_ID_ENV) != run_id:
        return False
    try:
        agent = int(environ.get(AGENT_PID_ENV, ""))
    except ValueError:
        return False
    return parent is not None and parent != agent and not agent_alive(agent)


def _own_processes() -> Iterator[int]:
    uid = os.getuid()
    me = os.getpid()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == me:
            continue
        with contextlib.suppress(OSError):
            if entry.stat().st_uid == uid:
                yield int(entry.name)


def end_strays(run_id: str) -> list[int]:
    """Ends (SIGKILL, with their sessions) the stray workers of job ``run_id`` on this host;
    returns their pids and says so in one line if there were any."""
    strays = [pid for pid in _own_processes()
              if is_stray(_environ(pid), _parent(pid), run_id, procs.exists)]
    for pid in strays:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            if os.getpgid(pid) == pid:
                os.killpg(pid, signal.SIGKILL)
            else:
                os.kill(pid, signal.SIGKILL)
    if strays:
        logger.warning("ended %d stray worker(s) of job %s left by an agent that is gone "
                       "(pids %s)", len(strays), run_id, ", ".join(map(str, strays)))
    return strays
