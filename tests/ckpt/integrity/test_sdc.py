"""Fingerprints of the replicated state read from real snapshots, and the pure comparison of
them (a table of cases): a minority named, two replicas undecidable and then decided."""

from __future__ import annotations

import zlib

import pytest
import torch

from elasticft.ckpt import Checkpointer, WorkerSettings, capture
from elasticft.ckpt.integrity.fingerprint import Fingerprint, fingerprint_slot, replica_set_key
from elasticft.ckpt.integrity.sdc import (
    Remedy,
    Verdict,
    compare,
    decide_by_health,
    decide_by_recomputation,
    decide_undecided,
    respond,
)
from elasticft.ckpt.memory.shm import SlotSet
from tests.ckpt.helpers import remove_segments, trained_model, unique_prefix


@pytest.fixture
def prefix():
    name = unique_prefix()
    yield name
    remove_segments(name)


def _fingerprint_of_save(prefix: str, model, optim, step: int = 1) -> Fingerprint | None:
    settings = WorkerSettings(shm_slots=prefix, agent_owned=True, slots=2)
    with Checkpointer(settings, optimizers=[optim], rank=0, world_size=1) as ckpt:
        assert ckpt.save(step, capture(model, optim, {"step": step})).wait(30).status == "memory"
    slots = SlotSet(prefix, 2)
    try:
        index, _ = slots.newest()
        slot = slots.get(index)
        assert slot is not None
        return fingerprint_slot(slot, step, 0)
    finally:
        slots.close()


@pytest.mark.timeout(60)
def test_fingerprint_covers_parameters_and_optimizer_state_and_sees_one_bit(prefix: str) -> None:
    model, optim = trained_model()
    first = _fingerprint_of_save(prefix, model, optim)
    assert first is not None and first.step == 1
    names = [name for name, _ in first.items]
    assert any(n.startswith("model.") for n in names)
    assert any(n.startswith("optim.state.") for n in names)
    expected = sum(p.numel() * 4 for p in model.parameters()) * 3  # weights, exp_avg(_sq)
    assert first.nbytes >= expected
    remove_segments(prefix)
    again = _fingerprint_of_save(unique_prefix(), *(model, optim))
    assert again is not None and again.digest == first.digest
    # One bit of one weight.
    with torch.no_grad():
        weight = model[0].weight.view(-1).view(torch.int32)
        weight[5] ^= 1
    flipped_prefix = unique_prefix()
    try:
        flipped = _fingerprint_of_save(flipped_prefix, model, optim)
    finally:
        remove_segments(flipped_prefix)
    assert flipped is not None and flipped.digest != first.digest
    assert flipped.replica_set == first.replica_set
    pairs = zip(first.items, flipped.items, strict=True)
    assert [n for (n, a), (_, b) in pairs if a != b] == ["model.0.weight"]


def _fp(rank: int, digest: str, replica_set: str = "dp", step: int = 10) -> Fingerprint:
    return Fingerprint(rank=rank, step=step, world_size=4, replica_set=replica_set,
                       digest=digest, items=(("w", zlib.crc32(digest.encode())),))


NODES = {0: "a", 1: "a", 2: "b", 3: "b"}


@pytest.mark.timeout(10)
@pytest.mark.parametrize(("fingerprints", "expected"), [
    # DDP, 4 ranks, all agree.
    ([_fp(r, "x") for r in range(4)], [(Verdict.AGREE, ())]),
    # One of four differs: named.
    ([_fp(0, "x"), _fp(1, "x"), _fp(2, "BAD"), _fp(3, "x")], [(Verdict.SUSPECT, (2,))]),
    # Three of four agree on x, one differs in its own way each: still a strict majority.
    ([_fp(0, "y"), _fp(1, "x"), _fp(2, "x"), _fp(3, "x")], [(Verdict.SUSPECT, (0,))]),
    # Two against two: no majority.
    ([_fp(0, "x"), _fp(1, "x"), _fp(2, "y"), _fp(3, "y")], [(Verdict.UNDECIDABLE, (0, 1, 2, 3))]),
    # Two replicas: undecidable.
    ([_fp(0, "x"), _fp(1, "y")], [(Verdict.UNDECIDABLE, (0, 1))]),
    # Three replicas, all different: undecidable.
    ([_fp(0, "x"), _fp(1, "y"), _fp(2, "z")], [(Verdict.UNDECIDABLE, (0, 1, 2))]),
    # HSDP 2x2: shards s0 = {0, 2}, s1 = {1, 3}; shards differ by nature, replicas agree.
    ([_fp(0, "s0", "A"), _fp(1, "s1", "B"), _fp(2, "s0", "A"), _fp(3, "s1", "B")],
     [(Verdict.AGREE, ()), (Verdict.AGREE, ())]),
    # HSDP: rank 3 diverged from its one replica (rank 1): undecidable in that set only.
    ([_fp(0, "s0", "A"), _fp(1, "s1", "B"), _fp(2, "s0", "A"), _fp(3, "bad", "B")],
     [(Verdict.AGREE, ()), (Verdict.UNDECIDABLE, (1, 3))]),
    # A set of one rank (pure sharding) has nothing to compare.
    ([_fp(0, "x", "A"), _fp(1, "y", "B")], []),
])
def test_compare(fingerprints, expected) -> None:
    findings = compare(fingerprints, NODES)
    assert [(f.kind, f.suspects) for f in findings] == expected
    for f in findings:
        assert f.reason
        assert set(f.digests) <= {fp.rank for fp in fingerprints}
        if f.kind is not Verdict.AGREE:
            assert f.nodes == tuple(NODES[r] for r in f.suspects)
            assert f.items == ("w",)


PAIR = [_fp(0, "x"), _fp(2, "y")]


@pytest.mark.timeout(10)
@pytest.mark.parametrize(("recomputed", "healthy", "kind", "suspects"), [
    # No new evidence: still undecidable.
    ({}, {}, Verdict.UNDECIDABLE, (0, 2)),
    ({0: "x", 2: "y"}, {"a": True, "b": True}, Verdict.UNDECIDABLE, (0, 2)),
    # Rank 2's snapshot reads differently on a second pass: its memory is faulty.
    ({0: "x", 2: "z"}, {}, Verdict.SUSPECT, (2,)),
    # Node b fails its health check, node a passes.
    ({0: "x", 2: "y"}, {"a": True, "b": False}, Verdict.SUSPECT, (2,)),
    # Both fail, or only one was checked and failed with no passing peer: still undecidable.
    ({}, {"a": False, "b": False}, Verdict.UNDECIDABLE, (0, 2)),
    ({}, {"b": False}, Verdict.UNDECIDABLE, (0, 2)),
    # Snapshots gone (None): no evidence from them.
    ({0: None, 2: None}, {"a": False, "b": True}, Verdict.SUSPECT, (0,)),
])
def test_two_replicas_are_decided_from_the_next_evidence(recomputed, healthy, kind,
                                                         suspects) -> None:
    (finding,) = compare(PAIR, NODES)
    assert finding.kind is Verdict.UNDECIDABLE
    decided = decide_undecided(finding, recomputed, healthy)
    assert (decided.kind, decided.suspects) == (kind, suspects)
    assert decided.nodes == tuple(NODES[r] for r in suspects)


@pytest.mark.timeout(10)
@pytest.mark.parametrize(("pair", "healthy", "kind", "suspects", "nodes"), [
    # Replicas on two nodes (ranks 0 on a, 2 on b), after a recomputation said nothing.
    (PAIR, {"a": True, "b": False}, Verdict.SUSPECT, (2,), ("b",)),
    (PAIR, {"a": False, "b": True}, Verdict.SUSPECT, (0,), ("a",)),
    # Both pass, both fail, one unchecked, none checked: nothing said.
    (PAIR, {"a": True, "b": True}, Verdict.UNDECIDABLE, (0, 2), ("a", "b")),
    (PAIR, {"a": False, "b": False}, Verdict.UNDECIDABLE, (0, 2), ("a", "b")),
    (PAIR, {"a": None, "b": False}, Verdict.UNDECIDABLE, (0, 2), ("a", "b")),
    (PAIR, {}, Verdict.UNDECIDABLE, (0, 2), ("a", "b")),
    # Both replicas on one node: its check cannot tell them apart.
    ([_fp(0, "x"), _fp(1, "y")], {"a": False, "b": True}, Verdict.UNDECIDABLE, (0, 1),
     ("a", "a")),
    # Four ranks split two against two across the nodes: node b's pair is named.
    ([_fp(0, "x"), _fp(1, "x"), _fp(2, "y"), _fp(3, "y")], {"a": True, "b": False},
     Verdict.SUSPECT, (2, 3), ("b", "b")),
])
def test_replicas_across_nodes_are_decided_by_the_nodes_health(pair, healthy, kind, suspects,
                                                               nodes) -> None:
    (finding,) = compare(pair, NODES)
    assert finding.kind is Verdict.UNDECIDABLE
    decided = decide_by_health(finding, healthy)
    assert (decided.kind, decided.suspects, decided.nodes) == (kind, suspects, nodes)
    assert decided.decided_by == ("health" if kind is Verdict.SUSPECT else "")
    # A finding already decided is left as it is.
    assert decide_by_health(decided, {"a": False, "b": True}) == decided or \
        decided.kind is Verdict.UNDECIDABLE


def _item(fqn: str, shape: list[int], offsets: list[int], placements: list[str] | None):
    sharding = {"mesh": [2, 2], "placements": placements} if placements else None
    return {"fqn": fqn, "shape": shape, "chunk_offsets": offsets, "sharding": sharding}


@pytest.mark.timeout(10)
def test_replica_sets_follow_the_shard_each_rank_holds() -> None:
    # HSDP on a (replicate=2, shard=2) mesh: ranks 0 and 2 hold rows 0-3, ranks 1 and 3 rows 4-7.
    hsdp = {r: replica_set_key([_item("w", [4, 8], [4 * (r % 2), 0], ["R", "S(0)"])], (0, 0))
            for r in range(4)}
    assert hsdp[0] == hsdp[2] and hsdp[1] == hsdp[3] and hsdp[0] != hsdp[1]
    # Plain DDP: every rank the same set.
    ddp = {replica_set_key([_item("w", [8, 8], [0, 0], None)], (0, 0)) for _ in range(4)}
    assert len(ddp) == 1
    # TP x DP with whole-looking local tensors: the tp coordinate keeps TP peers apart.
    from elasticft.ckpt.integrity.fingerprint import coordinates
    tpdp = {r: replica_set_key([_item("w", [4, 8], [0, 0], None)], coordinates(r, 4, (2, 1, 2)))
            for r in range(4)}
    assert tpdp[0] == tpdp[2] and tpdp[1] == tpdp[3] and tpdp[0] != tpdp[1]


@pytest.mark.timeout(10)
@pytest.mark.parametrize(("recomputed", "kind", "suspects"), [
    # The step computed again agrees with rank 0's first result: rank 2 computed it wrongly.
    ({0: "x", 2: "x"}, Verdict.SUSPECT, (2,)),
    ({0: "y", 2: "y"}, Verdict.SUSPECT, (0,)),
    # It agrees with neither first result (the error had spread): nobody can be named.
    ({0: "z", 2: "z"}, Verdict.UNDECIDABLE, (0, 2)),
    # Still different; rank 2's result changed, rank 0's did not: rank 2 is not reproducible.
    ({0: "x", 2: "w"}, Verdict.SUSPECT, (2,)),
    # Each reproduces its own result (a persistent fault): undecidable.
    ({0: "x", 2: "y"}, Verdict.UNDECIDABLE, (0, 2)),
    # A rank's step not computed again: no evidence.
    ({0: "x"}, Verdict.UNDECIDABLE, (0, 2)),
    ({0: "x", 2: None}, Verdict.UNDECIDABLE, (0, 2)),
])
def test_two_replicas_are_decided_by_recomputing_the_step(recomputed, kind, suspects) -> None:
    (finding,) = compare(PAIR, NODES)
    decided = decide_by_recomputation(finding, recomputed)
    assert (decided.kind, decided.suspects) == (kind, suspects)
    assert decided.decided_by == ("recomputation" if kind is Verdict.SUSPECT else "")
    assert decided.nodes == tuple(NODES[r] for r in suspects)


NAMED = compare([_fp(0, "x"), _fp(1, "x"), _fp(2, "BAD"), _fp(3, "x")], NODES)[0]
SPLIT = compare(PAIR, NODES)[0]
AGREED = compare([_fp(0, "x"), _fp(1, "x")], NODES)[0]


@pytest.mark.timeout(10)
@pytest.mark.parametrize(("finding", "action", "agreed", "again", "remedy", "at_most", "nodes"), [
    # Report only: nothing is done, whatever was found.
    (NAMED, "report", 8, False, Remedy.NONE, None, ()),
    (SPLIT, "report", 8, False, Remedy.NONE, None, ()),
    (AGREED, "evict", 8, False, Remedy.NONE, None, ()),
    # A rank named at step 10: its node goes, every node restores step 8 and redoes 9 and 10.
    (NAMED, "evict", 8, False, Remedy.EVICT, 8, ("b",)),
    # Nothing agreed yet: back to the beginning.
    (NAMED, "evict", None, False, Remedy.EVICT, -1, ("b",)),
    # Named by the recomputation of a step that now agrees: evicted, nothing to redo.
    (NAMED, "evict", 10, True, Remedy.EVICT, None, ("b",)),
    # Two replicas differ: the step is computed again from step 8 on every replica.
    (SPLIT, "evict", 8, False, Remedy.RECOMPUTE, 8, ()),
    # ... once: computed twice and still split, the next evidence is the nodes' health.
    (SPLIT, "evict", 8, True, Remedy.NONE, None, ()),
])
def test_respond(finding, action, agreed, again, remedy, at_most, nodes) -> None:
    response = respond(finding, action, agreed, again)
    assert (response.kind, response.restore_at_most, response.nodes) == \
        (remedy, at_most, nodes)
    assert response.reason
    if remedy is not Remedy.NONE:
        assert response.ranks == finding.suspects
