"""What an agent can tell about a process from its pid alone (Linux).

The agent judges its workers and the owners of leftover files by pid: a one-letter state from
``/proc/<pid>/stat`` (R running, S sleeping, T stopped, Z zombie...) and whether any process
still has the pid at all.
"""

from __future__ import annotations

import os

STOPPED_STATES = frozenset({"T", "t", "Z", "X"})
"""States in which a process cannot answer: stopped (SIGSTOP, a tracer), or exited."""
EXITED_STATES = frozenset({"Z", "X"})


def state(pid: int | None) -> str | None:
    """The process's state letter, or None when there is no such process (or no pid)."""
    if not pid:
        return None
    try:
        with open(f"/proc/{pid}/stat") as f:
            # The command name may hold spaces and parentheses: the state follows the last ')'.
            return f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return None


def exists(pid: int | None) -> bool:
    """The process has not exited (it may be stopped, still holding its sockets and memory)."""
    current = state(pid)
    return current is not None and current not in EXITED_STATES


def responsive(pid: int | None) -> bool:
    """The process exists and is neither stopped nor exited."""
    current = state(pid)
    return current is not None and current not in STOPPED_STATES


def gone(pid: int) -> bool:
    """No process has this pid any more. A pid taken by another user's process is not gone."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    return False
