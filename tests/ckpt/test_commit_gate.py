"""The commit gate: a registered gate refuses a save when it starts, and a snapshot already being
copied when the gate closes is not sealed, so no tier (every one reads complete snapshots only)
ever takes it; the gate's owner decides when (in-process recovery: after its groups were ended)."""

from __future__ import annotations

import pytest

from elasticft.ckpt import Checkpointer, WorkerSettings, capture
from elasticft.ckpt.memory.shm import SlotSet
from elasticft.ckpt.memory.slotformat import COMPLETE, WRITING
from tests.ckpt.helpers import remove_segments, trained_model, unique_prefix


class Refused(BaseException):
    """What the gate below raises through ``save`` (a BaseException, as in-process recovery's)."""


class Gate:
    """A gate whose answers are given as data: ``answers[i]`` is its i-th answer (True: may
    commit); the period it is asked about is recorded."""

    def __init__(self, *answers: bool) -> None:
        self.answers = list(answers)
        self.asked: list[int] = []

    def current(self) -> int:
        return 7

    def refusal(self, taken_in: int) -> BaseException | None:
        self.asked.append(taken_in)
        return None if self.answers.pop(0) else Refused(f"period {taken_in} is over")


@pytest.fixture
def prefix():
    name = unique_prefix()
    yield name
    remove_segments(name)


@pytest.mark.timeout(60)
@pytest.mark.parametrize(("answers", "status", "sealed"), [
    ((True, True), "memory", True),  # open at the save and at the seal
    ((True, False), "refused", False),  # closed while the snapshot was being copied
    ((False,), None, False),  # closed when the save starts: save raises, nothing is copied
], ids=["open", "closed-at-the-seal", "closed-at-the-save"])
def test_a_refused_snapshot_never_becomes_complete(
        prefix: str, answers: tuple[bool, ...], status: str | None, sealed: bool) -> None:
    model, optim = trained_model()
    gate = Gate(True, True, *answers)
    handle = Checkpointer.register_commit_gate(gate)
    try:
        with Checkpointer(WorkerSettings(shm_slots=prefix, agent_owned=True, slots=3),
                          optimizers=[optim]) as ckpt:
            assert ckpt.save(1, capture(model, optim, {"step": 1})).wait(30).status == "memory"
            if status is None:
                with pytest.raises(Refused):
                    ckpt.save(2, capture(model, optim, {"step": 2}))
            else:
                request = ckpt.save(2, capture(model, optim, {"step": 2}))
                request._done.wait(30)
                assert request.status == status
                if not sealed:
                    with pytest.raises(Refused):
                        request.wait(0)
            assert ckpt.newest_step() == (2 if sealed else 1)
            slots = SlotSet(prefix, 3)
            states = {h.step: h.state for h in slots.headers().values()}
            slots.close()
    finally:
        handle.remove()
    assert states[1] == COMPLETE
    assert states.get(2) == (COMPLETE if sealed else WRITING if status else None)
    assert gate.asked == [7] * (2 + len(answers)) and not gate.answers


@pytest.mark.timeout(60)
def test_a_removed_gate_is_no_longer_asked(prefix: str) -> None:
    model, optim = trained_model()
    gate = Gate()
    Checkpointer.register_commit_gate(gate).remove()
    with Checkpointer(WorkerSettings(shm_slots=prefix, agent_owned=True),
                      optimizers=[optim]) as ckpt:
        assert ckpt.save(1, capture(model, optim, {"step": 1})).wait(30).status == "memory"
    assert gate.asked == []
