"""The fingerprints' watch with real memory slots in this process: under ckpt_sdc_action evict
it holds the agreed step and the first results of the step after it, whatever the saves that
follow, and lets them go when the workers restart after a rollback."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from elasticft.addon.api import GroupInfo, WorkerInfo
from elasticft.ckpt import Checkpointer, WorkerSettings, capture
from elasticft.ckpt.integrity.sdcwatch import FingerprintWatch, evidence_slots
from elasticft.ckpt.memory.nodeslots import NodeSlots
from elasticft.config import CheckpointConfig
from tests.ckpt.helpers import trained_model

WORKERS = tuple(WorkerInfo(local_rank=r, global_rank=r, world_size=2) for r in range(2))


def _group(tmp_path: Path) -> GroupInfo:
    return GroupInfo(run_id="sdcwatch", node_id="n0", run_dir=tmp_path, round=0, group_rank=0,
                     group_world_size=1, restart_count=0, workers=WORKERS)


class _Job:
    """Two replicas saving into the node's slots as workers do: the same model and optimizer,
    or (``apart``) two trained from different seeds, as replicas that always differ."""

    def __init__(self, slots: NodeSlots, apart: bool = False) -> None:
        self.states = [trained_model(seed=w.global_rank if apart else 0) for w in WORKERS]
        self.ckpts = [Checkpointer(WorkerSettings(shm_slots=slots.slot_set(w.local_rank).where,
                                                  slots=slots.count, agent_owned=True),
                                   optimizers=[optim], rank=w.global_rank, world_size=2)
                      for w, (_, optim) in zip(WORKERS, self.states, strict=True)]

    def save(self, step: int) -> None:
        for ckpt, (model, optim) in zip(self.ckpts, self.states, strict=True):
            request = ckpt.save(step, capture(model, optim, {"step": step})).wait(30)
            assert request.status == "memory", request.skipped

    def close(self) -> None:
        for ckpt in self.ckpts:
            ckpt.close()


def _tick(watch: FingerprintWatch, group: GroupInfo) -> None:
    watch.tick(group)
    watch.wait(30)


@pytest.mark.timeout(120)
def test_the_agreed_step_and_the_first_results_after_it_outlive_any_later_saves(
        tmp_path: Path) -> None:
    config = CheckpointConfig(ckpt_fingerprint_every=2, ckpt_sdc_action="evict")
    assert evidence_slots(config) == 1
    assert evidence_slots(CheckpointConfig(ckpt_fingerprint_every=2)) == 0
    slots = NodeSlots(config.ckpt_memory_slots + evidence_slots(config))
    events: list[tuple[str, dict]] = []
    watch = FingerprintWatch(slots, 2, None, lambda kind, **e: events.append((kind, e)),
                             "evict")
    group = _group(tmp_path)
    watch.restarted(group, time.time())
    job = _Job(slots)
    try:
        for step in (1, 2, 3):
            job.save(step)
            _tick(watch, group)
        assert (watch.agreed_step, watch.pinned_step, watch.evidence_step) == (2, 2, 3)
        # The watch falls behind: six saves, and not one tick. Every save finds a slot (none is
        # skipped), and steps 2 and 3 are still there.
        for step in range(4, 10):
            job.save(step)
        assert {2, 3, 9} <= slots.common_steps(WORKERS), slots.common_steps(WORKERS)
        assert [f.digest for f in watch.fingerprints(group, 3)] != []
        # The watch catches up: the oldest due step it still holds is 8, which agrees; the
        # evidence moves to step 9.
        _tick(watch, group)
        assert (watch.agreed_step, watch.pinned_step, watch.evidence_step) == (8, 8, 9)
        job.save(10)
        job.save(11)
        assert 3 not in slots.common_steps(WORKERS)
        assert not events, events
        # A rollback's restart: the previous attempt's first results are let go.
        watch.restore_at_most = 8
        watch.restarted(group, time.time())
        assert watch.evidence_step is None
    finally:
        watch.close(10)
        job.close()
        slots.close()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("repeats", [True, False], ids=["fault-repeats", "both-changed"])
def test_a_recomputation_that_names_nobody_is_reported_with_both_results(
        tmp_path: Path, repeats: bool) -> None:
    # Two replicas differ at step 2: undecidable, so the job rolls back and computes it again.
    # Either they differ the same way again (a fault that repeats), or they agree on a third
    # result (each side's first result had changed: what recomputing a step after the first
    # divergent one finds). Neither names anybody, and that is an event too, with both
    # results as its evidence, not a silent rollback.
    slots = NodeSlots(4)
    events: list[tuple[str, dict]] = []
    watch = FingerprintWatch(slots, 2, None, lambda kind, **e: events.append((kind, e)),
                             "evict")
    group = _group(tmp_path)
    watch.restarted(group, time.time())
    job = _Job(slots, apart=True)
    try:
        job.save(1)
        job.save(2)
        _tick(watch, group)
        assert [k for k, _ in events] == ["sdc_undecidable", "sdc_response"], events
        assert events[1][1]["remedy"] == "recompute"
        assert watch.detection() is not None and watch.restore_at_most == -1
        first = {str(fp["rank"]): fp["digest"] for fp in events[0][1]["fingerprints"]}
        watch.restarted(group, time.time())
        if not repeats:
            model, optim = trained_model(seed=5)
            for own_model, own_optim in job.states:
                own_model.load_state_dict(model.state_dict())
                own_optim.load_state_dict(optim.state_dict())
        job.save(1)
        job.save(2)
        _tick(watch, group)
        assert [k for k, _ in events[2:]] == ["sdc_undecidable"], events
        again = events[-1][1]
        assert (again["step"], again["ranks"]) == (2, [0, 1]), again
        assert again["first_results"] == first
        recomputed = {str(fp["rank"]): fp["digest"] for fp in again["fingerprints"]}
        if repeats:
            assert recomputed == first
        else:
            assert recomputed["0"] == recomputed["1"] and set(first.values()).isdisjoint(
                recomputed.values())
            assert "computed step 2 again" in again["reason"], again
    finally:
        watch.close(10)
        job.close()
        slots.close()
