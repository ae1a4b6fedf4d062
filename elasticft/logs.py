"""How elasticft's log lines look: torch's own shape, so that a launcher's output reads as one log.

torch.distributed's elastic agent prints its lines in glog's shape::

    W1126 08:50:57.940000 6762 torch/distributed/run.py:874] Setting OMP_NUM_THREADS ...

the level's letter (V for debug, I, W, E, C), month and day, the time to the microsecond, the
process id, and the source file as imported (relative to its ``sys.path`` entry) with its line.
elasticft's commands configure Python's root logger with :class:`GlogFormatter`, which writes
exactly that, so elasticft's lines and torch's sort and grep together::

    W1126 08:51:09.580000 6762 elasticft/agent/agent.py:322] worker failure: rank 1 ...

A message of several lines gets the prefix on each, as torch does.
"""

from __future__ import annotations

import logging
import os
import sys
import time

LEVEL_LETTERS = {"DEBUG": "V", "INFO": "I", "WARNING": "W", "ERROR": "E", "CRITICAL": "C"}


def source_path(pathname: str, roots: list[str] | None = None, logger: str = "") -> str:
    """``pathname`` as an import names it (``elasticft/agent/agent.py``): the tail that its
    logger's dotted name spells (an editable install's modules are on no ``sys.path`` entry),
    else relative to the longest ``sys.path`` entry (or ``roots``) that holds it."""
    spelled = logger.replace(".", os.sep)
    for tail in (spelled + ".py", os.path.join(spelled, "__init__.py")):
        if spelled and (pathname == tail or pathname.endswith(os.sep + tail)):
            return tail
    candidates = [os.path.abspath(r) for r in (sys.path if roots is None else roots) if r]
    holding = [r for r in candidates if pathname.startswith(r.rstrip(os.sep) + os.sep)]
    if not holding:
        return pathname
    return os.path.relpath(pathname, max(holding, key=len))


class GlogFormatter(logging.Formatter):
    """``<L><mmdd> <HH:MM:SS.ffffff> <pid> <source>:<line>] <message>``, per line of the
    message (a traceback included)."""

    def format(self, record: logging.LogRecord) -> str:
        text = record.getMessage()
        if record.exc_info and not record.exc_text:
            record.exc_text = self.formatException(record.exc_info)
        if record.exc_text:
            text = f"{text.rstrip()}\n{record.exc_text}"
        if record.stack_info:
            text = f"{text.rstrip()}\n{self.formatStack(record.stack_info)}"
        stamp = time.strftime("%m%d %H:%M:%S", time.localtime(record.created))
        prefix = (f"{LEVEL_LETTERS.get(record.levelname, record.levelname)}{stamp}."
                  f"{int(record.msecs * 1000):06d} {record.process} "
                  f"{source_path(record.pathname, logger=record.name)}:{record.lineno}]")
        return "\n".join(f"{prefix} {line}" for line in text.split("\n"))


def configure(level: str | int) -> None:
    """The root logger at ``level`` with :class:`GlogFormatter` on stderr (once: a second call,
    or a handler the program installed first, leaves the handlers as they are)."""
    handler = logging.StreamHandler()
    handler.setFormatter(GlogFormatter())
    logging.basicConfig(level=level.upper() if isinstance(level, str) else level,
                        handlers=[handler])
