"""The log scanner: error lines in the workers' captured logs, counted in a sliding window.

Which node logged the first error line matters most (TRANSOM): it is usually where the fault
began, while the other nodes only log their timeouts later.
"""

from __future__ import annotations

import collections
import contextlib
import re
import time
from pathlib import Path

from elasticft.diag import detectors


class LogScanner:
    """Tails the workers' captured logs and counts error lines in a sliding window (TRANSOM)."""

    def __init__(self, pattern: re.Pattern[str], window_s: float) -> None:
        self.pattern = pattern
        self.window_s = window_s
        self._root: Path | None = None
        self._offsets: dict[Path, int] = {}
        self._errors: collections.deque[tuple[float, str]] = collections.deque(maxlen=10000)
        self._first: tuple[float, str] | None = None
        self._last_scan = 0.0
        self._started = 0.0

    def reset(self, root: Path | None) -> None:
        self._root = root
        self._errors.clear()
        self._first = None
        self._started = time.time()

    def _files(self) -> list[Path]:
        if self._root is None or not self._root.is_dir():
            return []
        return [p for p in self._root.rglob("std*.log")
                if p.stat().st_mtime >= self._started - 1]

    def scan(self, now_s: float, node: str) -> detectors.LogBurst | None:
        if now_s - self._last_scan < 1.0:
            return None
        self._last_scan = now_s
        for path in self._files():
            offset = self._offsets.get(path, 0)
            with contextlib.suppress(OSError), open(path, errors="replace") as f:
                f.seek(offset)
                chunk = f.read(1 << 20)
                self._offsets[path] = f.tell()
                for line in chunk.splitlines():
                    if self.pattern.search(line):
                        self._errors.append((now_s, line.strip()[:300]))
                        if self._first is None:
                            self._first = (now_s, line.strip()[:300])
        while self._errors and self._errors[0][0] < now_s - self.window_s:
            self._errors.popleft()
        if not self._errors or self._first is None:
            return None
        return detectors.LogBurst(len(self._errors), self.window_s, node, self._first[1])

