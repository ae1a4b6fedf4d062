"""A node's health, as the evidence that settles a split between two replicas on two nodes.

When two replicas on different nodes differ, the bytes cannot say which is wrong, and a
recomputation may not either (:func:`elasticft.ckpt.integrity.sdc.decide_by_recomputation`).
The next evidence is each node's health (:func:`elasticft.ckpt.integrity.sdc.decide_by_health`):
:class:`NodeHealth` is this node's, taken each time its fingerprints are published:

* the **agent's node health checks**: a critical ``detection`` the diagnostics logged for this
  node (detector ``node_health``: NVML's faults as :func:`elasticft.devicehealth.nvml_problems`
  decides them, a GPU gone, host memory; or ``preflight``), read from the agent's event log as
  it grows;
* a **known-answer computation**: a small float64 matmul whose exact result is known, in the
  agent's process (milliseconds; :func:`elasticft.devicehealth.known_answer`, the one the
  rendezvous admission runs too).

Either failing makes the node fail; otherwise it passes.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from pathlib import Path

from elasticft.devicehealth import known_answer
from elasticft.jsonfile import LineTail

logger = logging.getLogger(__name__)

HEALTH_DETECTORS = ("node_health", "preflight")
"""The detectors whose critical findings make a node fail."""


def known_answer_check() -> str | None:
    """A wrong result of the known-answer matmul (:func:`elasticft.devicehealth.known_answer`),
    described; None when right."""
    verdict = known_answer()
    return None if verdict.ok else verdict.detail


class NodeHealth:
    """This node's health check for the fingerprints' decision: (passed, what it found)."""

    def __init__(self, node: str, event_dir: Callable[[], Path | None],
                 compute: Callable[[], str | None] = known_answer_check) -> None:
        self.node = node
        self._event_dir = event_dir
        self._compute = compute
        self._tail = LineTail()
        self.failing: list[str] = []
        """The critical health findings logged for this node so far."""

    def __call__(self) -> tuple[bool | None, str]:
        self._read_new()
        found = list(self.failing)
        wrong = self._compute()
        if wrong is not None:
            found.append(wrong)
        if found:
            return False, "; ".join(found)
        return True, ("no critical node-health finding, and a known-answer computation is "
                      "right")

    def _read_new(self) -> None:
        """Reads the event log lines written since the last call (this node's files)."""
        directory = self._event_dir()
        if directory is None or not directory.is_dir():
            return
        safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in self.node)
        for path in sorted(directory.glob(f"events-{safe}-*.jsonl")):
            for line in self._tail.new_lines(path):
                if b'"detection"' not in line:
                    continue  # most lines: decoded only when they may be a detection
                try:
                    event = json.loads(line)
                except ValueError:
                    continue
                if (event.get("kind") == "detection" and event.get("critical")
                        and event.get("detector") in HEALTH_DETECTORS
                        and event.get("node") == self.node):
                    self.failing.append(f"{event['detector']}: {event.get('message', '')}")
