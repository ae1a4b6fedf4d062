"""The back-off policy after a lost rendezvous CAS: a pure function, checked against a table."""

from __future__ import annotations

import pytest

from elasticft.rendezvous.backend import CAS_BACKOFF_BASE_S, CAS_BACKOFF_CAP_S, cas_backoff_s


@pytest.mark.parametrize(
    ("losses", "draw", "expected_s"),
    [
        (0, 0.99, 0.0),  # nothing lost: no wait, whatever the draw
        (-1, 0.5, 0.0),  # nonsense count: no wait rather than a negative one
        (1, 0.0, 0.0),  # full jitter: the draw may give no wait at all
        (1, 0.5, 0.5 * CAS_BACKOFF_BASE_S),  # first loss: at most the base
        (2, 0.5, 0.5 * 2 * CAS_BACKOFF_BASE_S),  # the ceiling doubles per loss in a row
        (3, 1.0, 4 * CAS_BACKOFF_BASE_S),
        (6, 1.0, min(CAS_BACKOFF_CAP_S, 32 * CAS_BACKOFF_BASE_S)),
        (7, 1.0, CAS_BACKOFF_CAP_S),  # 0.64 s would exceed the cap
        (10_000, 1.0, CAS_BACKOFF_CAP_S),  # a long streak stays capped, no overflow
        (3, 1.7, 4 * CAS_BACKOFF_BASE_S),  # a draw outside [0, 1] is clamped
        (3, -0.2, 0.0),
    ],
)
def test_backoff_table(losses: int, draw: float, expected_s: float) -> None:
    assert cas_backoff_s(losses, draw) == pytest.approx(expected_s)


def test_backoff_uses_given_base_and_cap() -> None:
    assert cas_backoff_s(1, 1.0, base_s=0.2, cap_s=1.0) == pytest.approx(0.2)
    assert cas_backoff_s(4, 1.0, base_s=0.2, cap_s=1.0) == pytest.approx(1.0)
