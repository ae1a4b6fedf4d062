"""JSON records that processes leave for each other in files, written whole.

The agent and its workers talk through small JSON files (the in-process protocol's records, a
spare's assignment, the checkpoint control channel's requests and answers). A reader polls for
them and must never see half of one, so :func:`write_json` writes under a temporary name and
renames it into place (a rename within one directory is atomic); :func:`read_json` takes a
missing, unreadable or torn file for no record at all. Logs that grow a JSON line at a time are
read with :class:`LineTail`, which hands each complete line once.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any


def write_json(path: Path, value: Mapping[str, Any], *, private: bool = False,
               parents: bool = True) -> None:
    """Writes ``value`` to ``path`` whole: a temporary file beside it, then a rename.

    ``private``: readable by this user only (mode 0600; a record that holds a secret), else
    the process's umask decides as for any new file. ``parents``: creates the directory where it
is missing (else a missing directory raises: its owner is gone).
    """
    if parents:
        path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600 if private else 0o666)
    with os.fdopen(fd, "w") as f:
        json.dump(value, f)
    os.replace(tmp, path)


def read_json(path: Path) -> dict[str, Any] | None:
    """The record at ``path``, or None where there is none yet, or it is not a JSON object."""
    try:
        value = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return value if isinstance(value, dict) else None


class LineTail:
    """Reads the lines appended to files since the last call, one complete line at a time: a
    line still being written (no newline yet) waits for the next call."""

    def __init__(self) -> None:
        self._offsets: dict[Path, int] = {}

    def new_lines(self, path: Path) -> list[bytes]:
        """The complete lines written to ``path`` since the last call (none where it cannot be
        read)."""
        start = self._offsets.get(path, 0)
        try:
            with open(path, "rb") as f:
                f.seek(start)
                data = f.read()
        except OSError:
            return []
        end = data.rfind(b"\n") + 1
        self._offsets[path] = start + end
        return data[:end].splitlines()
