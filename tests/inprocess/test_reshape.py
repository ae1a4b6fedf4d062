"""The decision of a round that changes the world under running workers (pure, a table): in
process, or a restart with its reason (:func:`elasticft.inprocess.reshape.decide`)."""

from __future__ import annotations

import dataclasses

import pytest

from elasticft.inprocess.reshape import ReshapeFacts, decide
from elasticft.plan.api import Layout

TP2_DP2 = Layout(tp=2, pp=1, dp=2)
TP2_DP1 = Layout(tp=2, pp=1, dp=1, grad_accum=2)
SHRINK = ReshapeFacts(old=TP2_DP2, new=TP2_DP1, world_before=4, world_after=2,
                      ranks_per_node=2, moves={2: 0, 3: 1}, follows_layout=True)


def _with(**changes: object) -> ReshapeFacts:
    return dataclasses.replace(SHRINK, **changes)  # type: ignore[arg-type]


@pytest.mark.timeout(10)
@pytest.mark.parametrize(("facts", "in_process", "reason"), [
    (SHRINK, True, "every survivor keeps its TP shard"),
    (_with(moves={0: 0, 1: 1}), True, "TP2xPP1xDP2 (grad accum 1) -> TP2xPP1xDP1"),
    # Growing back: the newcomers take whole replicas.
    (_with(old=TP2_DP1, new=TP2_DP2, world_before=2, world_after=4, moves={0: 0, 1: 1}),
     True, "accumulation keeps the global batch"),
    # Pure data parallelism with accumulation.
    (_with(old=Layout(1, 1, 4), new=Layout(1, 1, 2, grad_accum=2), ranks_per_node=1,
           moves={3: 1}), True, "keeps its TP shard"),
    (_with(follows_layout=False), False, "does not follow a layout change"),
    (_with(new=None), False, "no layout for the new round"),
    (_with(old=None), False, "no layout for the running workers"),
    (_with(new=Layout(2, 1, 1, grad_accum=2)), True, "keeps"),
    (_with(world_after=3, new=Layout(2, 1, 1, grad_accum=2)), False, "leaves 1 of 3 ranks idle"),
    (_with(new=Layout(tp=1, pp=1, dp=2, grad_accum=1)), False,
     "TP degree changes from TP2 to TP1"),
    (_with(new=Layout(tp=2, pp=2, dp=1, grad_accum=2), world_after=4), False,
     "pipeline degree changes"),
    # A TP group over two nodes of one rank: the lost node took half of one.
    (_with(ranks_per_node=1, moves={2: 1}), False, "a TP group spans nodes"),
    (_with(moves={2: 1, 3: 0}), False, "rank 2 becomes rank 1, another TP position"),
    (_with(sharded_over=frozenset({"dp"})), False, "sharded over DP (FSDP2)"),
    (_with(sharded_over=frozenset({"dp_shard"})), False, "sharded over dp_shard"),
    (_with(new=Layout(2, 1, 1, grad_accum=1)), False, "global batch changes (DP x accumulation "
                                                      "2 -> 1)"),
], ids=["shrink-renumbered", "shrink-same-ranks", "grow-back", "pure-dp", "not-following",
        "no-new-layout", "no-old-layout", "same-shape", "idle-ranks", "tp-changes",
        "pp-changes", "tp-spans-nodes", "tp-position-moves", "fsdp-over-dp", "other-sharding",
        "global-batch"])
def test_decide(facts: ReshapeFacts, in_process: bool, reason: str) -> None:
    decision = decide(facts)
    assert decision.in_process is in_process, decision.reason
    assert reason in decision.reason, decision.reason


@pytest.mark.timeout(10)
def test_the_evidence_names_every_fact() -> None:
    assert SHRINK.evidence() == {
        "old": "TP2xPP1xDP2 (grad accum 1)", "new": "TP2xPP1xDP1 (grad accum 2)",
        "world": [4, 2], "ranks_per_node": 2, "moves": {"2": 0, "3": 1},
        "follows_layout": True, "sharded_over": []}
