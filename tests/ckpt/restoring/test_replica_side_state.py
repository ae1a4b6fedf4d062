"""Which step a rank restores when its newest is only another rank's data-parallel replica:
the replica's model and optimizer are this rank's, its RNG states and extras are not, so an
older step of the rank's own is preferred (:func:`older_own_step`)."""

from __future__ import annotations

from typing import Any

import pytest

from elasticft.ckpt.restoring.loader import older_own_step

TENSOR = {"path": ["model", "w"], "kind": "tensor"}
RNG = {"path": ["rng", "torch"], "kind": "tensor"}
EXTRA = {"path": ["extra", "step"], "kind": "value"}


def manifest(replica_of: int | None, *items: dict[str, Any]) -> dict[str, Any]:
    found: dict[str, Any] = {"items": list(items)}
    if replica_of is not None:
        found["replica_of"] = replica_of
    return found


@pytest.mark.parametrize(("rank", "step", "served", "own", "expected"), [
    (1, 6, manifest(None, TENSOR, RNG), [5, 4], None),          # its own snapshot
    (1, 6, manifest(1, TENSOR, RNG), [5], None),                # served as itself
    (1, 6, manifest(0, TENSOR), [5], None),                     # nothing of rank 0's own
    (1, 6, manifest(0, TENSOR, RNG), [5, 4], 5),                # rank 0's RNG: its own 5
    (1, 6, manifest(0, TENSOR, EXTRA), [3], 3),                 # rank 0's extras: its own 3
    (1, 6, manifest(0, TENSOR, RNG), [], None),                 # nothing of its own: taken
    (1, 6, manifest(0, TENSOR, RNG), [6, 7], None),             # nothing older of its own
], ids=["own", "as-itself", "no-side-state", "rng", "extras", "node-lost", "none-older"])
def test_a_replicas_side_state_gives_way_to_an_older_step_of_the_ranks_own(
        rank: int, step: int, served: dict[str, Any], own: list[int],
        expected: int | None) -> None:
    assert older_own_step(rank, step, served, own) == expected
