"""The next round's limit (:func:`elasticft.inprocess.next_round.round_overrun`), a pure decision
tested by a table; the round waited for with real agents is in test_inprocess_across_nodes.py."""

from __future__ import annotations

import pytest

from elasticft.inprocess.next_round import round_overrun

START = 1_000.0


@pytest.mark.parametrize(("name", "now", "limit_s", "over_s"), [
    ("just begun", START, 60.0, None),
    ("within its limit", START + 59.9, 60.0, None),
    ("at its limit", START + 60.0, 60.0, None),
    ("past its limit", START + 61.5, 60.0, 1.5),
    ("a short limit", START + 3.0, 2.0, 1.0),
])
def test_a_round_overruns_only_past_its_limit(name: str, now: float, limit_s: float,
                                              over_s: float | None) -> None:
    overrun = round_overrun(started_at=START, now=now, limit_s=limit_s)
    if over_s is None:
        assert overrun is None, name
        return
    assert overrun is not None, name
    assert overrun.evidence == {"started_at": START, "limit_s": limit_s, "seen_at": now,
                                "over_s": over_s}, name
    assert f"limit of {limit_s:.0f} s" in overrun.reason, name
