"""A node's health for the fingerprints' decision: the agent's critical health findings, read
from its event log as it grows, and a known-answer computation."""

from __future__ import annotations

from pathlib import Path

import pytest

from elasticft.ckpt.integrity.nodehealth import NodeHealth, known_answer_check
from elasticft.events import EventLog


@pytest.mark.timeout(30)
def test_a_critical_health_finding_of_this_node_makes_it_fail(tmp_path: Path) -> None:
    log = EventLog(tmp_path, "n1")
    other = EventLog(tmp_path, "n2")
    health = NodeHealth("n1", lambda: tmp_path)
    try:
        assert known_answer_check() is None
        ok, said = health()
        assert ok is True and "known-answer" in said
        # Not critical, another detector, another node: still passing.
        log.emit("detection", detector="node_health", message="GPU 0 at 85 C", critical=False)
        log.emit("detection", detector="hang", message="rank 1 hangs", critical=True)
        other.emit("detection", detector="node_health", message="ECC on n2", critical=True)
        assert health()[0] is True
        log.emit("detection", detector="node_health",
                 message="GPU 0: 2 uncorrectable ECC errors", critical=True)
        ok, said = health()
        assert ok is False and said == "node_health: GPU 0: 2 uncorrectable ECC errors"
        assert health() == (ok, said)  # read once, remembered
    finally:
        log.close()
        other.close()


@pytest.mark.timeout(30)
def test_a_wrong_known_answer_makes_the_node_fail(tmp_path: Path) -> None:
    health = NodeHealth("n1", lambda: None, compute=lambda: "matmul wrong")
    assert health() == (False, "matmul wrong")
