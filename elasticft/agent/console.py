"""What the console shows of the workers' stderr: every line, less the tracebacks of failures the
job recovers from.

A worker's stderr goes to its log file, and torch's tee copies it line by line to the launcher's
console. When one rank dies, the others fail in their next collective, and each prints a
traceback of some twenty lines (gloo's or NCCL's frames) before the agent logs the one line that
names the failure and what it does about it. Read on the console, those lines say the run failed
when it did not.

So a traceback is held back from the console (its log file has it whole, as written) until what
it belongs to is known:

- the rank writes another line after it: the script printed it and went on; it is shown;
- the workers are stopped and the run goes on (the agent restarts or recovers them): it is left
  out of the console; the agent's WARNING line names the failure, the worker's log holds it;
- the workers are stopped and the run stops: it is shown in full.

Likewise torch's "Sending process N closing signal SIGTERM", one WARNING per worker still
running (a killed one in the kernel's teardown included), is left out while the workers stop
for a restart: the agent's decision line has said so.

:class:`TracebackHold` decides line by line (pure); :class:`GatedTailLog` takes the place of torch's
stderr tail, with one hold per rank.
"""

from __future__ import annotations

import logging
import os
import re
import time
from threading import Event, Thread
from typing import Any, TextIO

from elasticft import torch_compat

TRACEBACK = "Traceback (most recent call last):"
RANK_PREFIX = re.compile(r"^\[rank\d+\]:\s?")
"""torch's prefix of a worker's exception lines (its excepthook writes ``[rank0]: ...``)."""
GOES_ON = ("During handling of the above exception", "The above exception was the direct cause",
           "At:", TRACEBACK)
"""Lines that continue a traceback after its exception line: a chained one, gloo's ``At:``."""
CLOSING_SIGNAL = "Sending process %s closing signal"
TORCH_LOGGER = "torch.distributed.elastic.multiprocessing.api"
"""torch's WARNING for each worker it stops (``SubprocessContext._close``), and its logger
(tests/agent/test_console.py checks both against torch)."""


class TracebackHold:
    """One rank's stderr lines, with a traceback held from its first line to what follows it."""

    def __init__(self) -> None:
        self.held: list[str] = []
        self._exception_seen = False

    def feed(self, line: str) -> list[str]:
        """The lines to show now, ``line`` being the rank's next one."""
        text = RANK_PREFIX.sub("", line.rstrip("\n"))
        if not self.held:
            if text.strip() != TRACEBACK:
                return [line]
            self.held, self._exception_seen = [line], False
            return []
        if self._continues(text):
            self.held.append(line)
            return []
        shown, self.held = self.held, []
        return shown + self.feed(line)

    def _continues(self, text: str) -> bool:
        if not text.strip() or text[0].isspace() or text.startswith(GOES_ON):
            if text.strip() == TRACEBACK:
                self._exception_seen = False
            return True
        if not self._exception_seen:  # the exception's own line ends the frames
            self._exception_seen = True
            return True
        return False

    def end(self, show: bool) -> list[str]:
        """The held lines to show once the rank's stream has ended (``show``: the run stops)."""
        shown, self.held = (self.held if show else []), []
        return shown


class GatedTailLog:
    """What torch's stderr ``TailLog`` does (each rank's log file copied to ``dst``, each line
    after the rank's header), with each rank's tracebacks held (:class:`TracebackHold`).
    The agent tells it after each decision whether the run goes on (:func:`run_goes_on`): the
    tracebacks still held when the workers stop are left out if it does, and shown if not."""

    def __init__(self, name: str, log_files: dict[int, str], dst: TextIO | None,
                 log_line_prefixes: dict[int, str] | None = None,
                 interval_s: float = 0.1) -> None:
        self._headers = {rank: (log_line_prefixes or {}).get(rank, f"[{name}{rank}]:")
                         for rank in log_files}
        self._files, self._dst, self._interval_s = log_files, dst, interval_s
        self._finished = Event()
        self._threads: list[Thread] = []
        self.run_goes_on = False
        self._torch_logger = logging.getLogger(TORCH_LOGGER)

    def filter(self, record: logging.LogRecord) -> bool:
        """torch's closing-signal line, left out while the run goes on (a logging filter)."""
        return not (self.run_goes_on and str(record.msg).startswith(CLOSING_SIGNAL))

    def start(self) -> GatedTailLog:
        self._torch_logger.addFilter(self)
        if self._dst is None:
            return self
        for rank, file in self._files.items():
            thread = Thread(target=self._tail, args=(self._headers[rank], file, self._dst),
                            name=f"elasticft-stderr-{rank}", daemon=True)
            thread.start()
            self._threads.append(thread)
        return self

    def stop(self) -> None:
        """Copies what the files hold still, then returns (the workers have stopped)."""
        self._finished.set()
        self._torch_logger.removeFilter(self)
        for thread in self._threads:
            thread.join()

    def stopped(self) -> bool:
        return self._finished.is_set()

    def _tail(self, header: str, file: str, dst: TextIO) -> None:
        while not os.path.exists(file):
            if self._finished.is_set():
                return
            time.sleep(self._interval_s)
        hold = TracebackHold()
        with open(file, errors="replace") as lines:
            while True:
                line = lines.readline()
                if line:
                    dst.writelines(f"{header}{shown}" for shown in hold.feed(line))
                elif self._finished.is_set():
                    break
                else:
                    time.sleep(self._interval_s)
        dst.writelines(f"{header}{shown}" for shown in hold.end(show=not self.run_goes_on))


def gate_tracebacks(context: Any) -> None:
    """Replaces the stderr tail of torch's process ``context`` (before its start) by a
    :class:`GatedTailLog` of the same files."""
    context.elasticft_stderr_tail = torch_compat.replace_stderr_tail(context, GatedTailLog)


def run_goes_on(context: Any, goes_on: bool) -> None:
    """Tells ``context``'s stderr tail whether the run goes on after the agent's latest
    decision (its workers restarted or recovered in process) or stops."""
    tail = getattr(context, "elasticft_stderr_tail", None)
    if tail is not None:
        tail.run_goes_on = goes_on
