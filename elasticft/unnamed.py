"""Files with no name: made by the agent, shared with its workers, freed with their last user.

A file the agent creates with ``O_TMPFILE`` (or ``memfd_create``) has no path that anyone must
remove: the kernel frees it when its last descriptor and mapping close, so even a SIGKILLed
agent leaves nothing behind. A worker opens it as ``/proc/<agent pid>/fd/<n>``
(:func:`path_of`), which gives it an open file description of its own to the same file: its
own offset and its own ``flock`` locks, as if it had opened the file by name.
"""

from __future__ import annotations

import errno
import os
from pathlib import Path


def anonymous_file(directory: Path) -> int:
    """An open, owner-only, read-write file that has no name: in ``directory``'s file system
    (``O_TMPFILE``, so a size-limited ``/dev/shm`` still bounds it), or an anonymous memory file
    where that file system cannot hold one. The descriptor is not inherited."""
    try:
        return os.open(directory, os.O_RDWR | os.O_TMPFILE, 0o600)
    except OSError as e:
        if e.errno not in (errno.EOPNOTSUPP, errno.EISDIR, errno.EINVAL):
            raise
    return os.memfd_create("elasticft")


def path_of(fd: int, pid: int | None = None) -> Path:
    """The path another process of the same user opens ``fd`` of process ``pid`` (default:
    this one) by."""
    return Path(f"/proc/{os.getpid() if pid is None else pid}/fd/{fd}")


def is_unnamed(path: Path) -> bool:
    """Whether ``path`` is a :func:`path_of` path (it cannot be created, renamed or removed)."""
    return path.parts[:2] == ("/", "proc") and path.parent.name == "fd"
