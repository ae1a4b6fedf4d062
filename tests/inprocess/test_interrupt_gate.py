"""No step committed after the interrupt, and an interrupt that ``except Exception:`` does not
swallow: the decision by table, the monitor's real thread and files, and one survivor in a real
gloo group of one whose step comes after its generation ended (its optimizer step, its save and
its checkpointers refuse it).

The monitor's thread raises into the main thread, which is pytest's here: every wait is for a
state, with a deadline.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from elasticft.ckpt import Checkpointer, WorkerSettings, capture
from elasticft.inprocess import InProcess
from elasticft.inprocess.generations import InProcessCoordinator
from elasticft.inprocess.groups import GroupOps
from elasticft.inprocess.interrupt import Monitor, PeerInterrupted, commit_refusal
from elasticft.inprocess.protocol import INTERRUPT_FILE, InProcessSettings, worker_file
from elasticft.jsonfile import read_json, write_json
from tests.ckpt.helpers import remove_segments, unique_prefix


def wait_for(state: Callable[[], bool], what: str, limit_s: float = 20.0) -> None:
    deadline = time.monotonic() + limit_s
    while not state():
        assert time.monotonic() < deadline, f"{what} within {limit_s} s"
        time.sleep(0.005)


@pytest.mark.parametrize(("taken_in", "ended", "refused"), [
    (0, -1, False),  # nothing ended yet
    (0, 0, True),  # the generation the step was taken in ended
    (1, 0, False),  # a step of the next generation, after the regroup
    (0, 1, True),  # a snapshot of an old generation sealed late
    (3, 3, True),
])
def test_what_a_generation_marked_over_refuses(taken_in: int, ended: int,
                                                refused: bool) -> None:
    why = commit_refusal(taken_in, ended)
    assert (why is not None) is refused
    if why is not None:
        assert f"generation {taken_in} ended" in why


def test_the_interrupt_is_outside_except_exception() -> None:
    assert not issubclass(PeerInterrupted, Exception)
    with pytest.raises(PeerInterrupted):
        try:
            raise PeerInterrupted("generation 0 ended")
        except Exception:  # a script's retry loop: must not catch it
            pytest.fail("except Exception: swallowed the interrupt")


@pytest.mark.timeout(60)
def test_the_generation_is_marked_over_before_its_groups_are_ended(tmp_path: Path) -> None:
    """``end`` is where a collective may start returning wrong results: the gate refuses from
    before it."""
    seen_in_end: list[bool] = []
    monitor: Monitor

    def end() -> str:
        seen_in_end.append(monitor.refusal(0) is not None)
        return "test"

    monitor = Monitor(tmp_path, read_json, end, grace_s=60.0)
    monitor.start()
    try:
        monitor.entering(0)
        assert monitor.refusal(0) is None and monitor.current() == 0
        write_json(tmp_path / INTERRUPT_FILE, {"ended": 0})
        wait_for(lambda: monitor.interrupted, "the monitor ended the groups")
        assert seen_in_end == [True]
        assert isinstance(monitor.refusal(0), PeerInterrupted)
        assert monitor.left(5.0)
        monitor.entering(1)
        assert monitor.refusal(1) is None  # the next generation commits again
        assert monitor.refusal(0) is not None  # an old generation's snapshot never does
    finally:
        monitor.stop()


@pytest.mark.timeout(60)
def test_a_protected_section_defers_the_interrupt_to_its_end(tmp_path: Path) -> None:
    """The monitor ends the groups while the main thread is in a protected section, and would
    raise into it every ``grace_s``: nothing lands there; the section's end raises at once."""
    ended: list[str] = []
    monitor = Monitor(tmp_path, read_json, lambda: ended.append("end") or "test", grace_s=0.01)
    monitor.start()
    finished = False
    try:
        monitor.entering(0)
        with pytest.raises(PeerInterrupted, match="end of a protected section"), \
                monitor.protected():
            write_json(tmp_path / INTERRUPT_FILE, {"ended": 0})
            wait_for(lambda: monitor.interrupted, "the monitor ended the groups")
            assert ended == ["end"]  # the groups are ended all the same
            # Python code, long enough for the monitor to try many times: were the
            # asynchronous exception raised, it would land in this loop.
            until = time.monotonic() + 50 * 0.01
            while time.monotonic() < until:
                pass
            finished = True
        assert finished
        assert monitor.left(5.0)
    finally:
        monitor.stop()

    # Unprotected, the same monitor's exception lands in Python code.
    monitor = Monitor(tmp_path / "again", read_json, lambda: "test", grace_s=0.01)
    (tmp_path / "again").mkdir()
    monitor.start()
    try:
        monitor.entering(0)
        write_json(tmp_path / "again" / INTERRUPT_FILE, {"ended": 0})
        with pytest.raises(PeerInterrupted):
            while True:
                pass
        assert monitor.left(5.0)
    finally:
        monitor.stop()


@pytest.mark.timeout(60)
def test_another_threads_section_does_not_defer_the_main_threads_interrupt(
        tmp_path: Path) -> None:
    monitor = Monitor(tmp_path, read_json, lambda: "test", grace_s=0.01)
    monitor.start()
    inside, release = threading.Event(), threading.Event()

    def section_elsewhere() -> None:
        with monitor.protected():
            inside.set()
            release.wait(30)

    other = threading.Thread(target=section_elsewhere, daemon=True)
    try:
        monitor.entering(0)
        other.start()
        assert inside.wait(10)
        write_json(tmp_path / INTERRUPT_FILE, {"ended": 0})
        with pytest.raises(PeerInterrupted):
            while True:
                pass
        assert monitor.left(5.0)
    finally:
        release.set()
        other.join(10)
        monitor.stop()


@pytest.mark.timeout(120)
def test_a_step_after_the_interrupt_is_refused_and_the_survivor_recovers(
        tmp_path: Path, group_of_one) -> None:
    """A survivor whose collective returned a wrong result after its groups were ended: the
    optimizer step, ``step_done`` and the save refuse it (the seal's refusal is
    tests/ckpt/test_commit_gate.py's), the script's ``except Exception:`` does not swallow the
    refusal, and the next generation trains and commits again."""
    directory = tmp_path / "ip"
    coordinator = InProcessCoordinator(directory, timeout_s=30)
    coordinator.reset()
    prefix = unique_prefix()
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 4)
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    ckpt = Checkpointer(WorkerSettings(shm_slots=prefix, agent_owned=True, slots=3),
                        optimizers=[optim])
    recovery = InProcess(InProcessSettings(directory=directory, timeout_s=30),
                         ops=GroupOps.for_torch())
    seen: dict[str, object] = {}

    def publish_after_failed() -> None:
        failed = worker_file(directory, "failed", 0)
        wait_for(failed.exists, "the survivor reported its failure", 60)
        coordinator.publish("127.0.0.1", world_size=1)

    def train() -> None:
        if recovery.generation > 0:
            model(torch.ones(2, 4)).sum().backward()
            optim.step()
            seen["committed_after"] = ckpt.save(3, capture(model, optim, {"step": 3})).wait(30)
            return
        assert ckpt.save(1, capture(model, optim, {"step": 1})).wait(30).status == "memory"
        with recovery.atomic():  # the interrupt lands nowhere here: the gate alone refuses
            write_json(directory / INTERRUPT_FILE, {"ended": 0})  # the agent's notice
            wait_for(lambda: recovery.monitor is not None and recovery.monitor.interrupted,
                     "the monitor ended the groups")
            threading.Thread(target=publish_after_failed, daemon=True).start()
            model(torch.ones(2, 4)).sum().backward()  # as if its all-reduce returned garbage
            before = [p.detach().clone() for p in model.parameters()]
            try:
                optim.step()
            except Exception:  # a script's own handler: the refusal is not an Exception
                pytest.fail("except Exception: swallowed the refusal")
            except PeerInterrupted as refused:
                seen["step"] = refused
            seen["unchanged"] = all(torch.equal(a, p) for a, p in zip(
                before, model.parameters(), strict=True))
            with pytest.raises(PeerInterrupted):
                recovery.step_done()
            with pytest.raises(PeerInterrupted):
                ckpt.save(2, capture(model, optim, {"step": 2}))
        pytest.fail("the end of the protected section did not raise")

    try:
        recovery.run(train)
        assert recovery.recoveries == 1
        assert isinstance(seen["step"], PeerInterrupted) and seen["unchanged"]
        assert getattr(seen["committed_after"], "status", None) == "memory"
        assert ckpt.newest_step() == 3
        slots = ckpt._slots
        assert slots is not None
        assert sorted(h.step for h in slots.complete().values()) == [1, 3]
    finally:
        ckpt.close()
        coordinator.close()
        remove_segments(prefix)


_PROFILED_AFTER_LEAVING = """
import cProfile, sys, tempfile
from pathlib import Path
from elasticft.inprocess.interrupt import Monitor
from elasticft.jsonfile import read_json

monitor = Monitor(Path(tempfile.mkdtemp()), read_json, lambda: "test")
monitor.start()
monitor.entering(0)
assert monitor.left(5.0)
with monitor.protected():
    pass
monitor.stop()
profile = cProfile.Profile()
profile.enable()
sum(len(str(n)) for n in range(1000))
profile.disable()
print("profiled", flush=True)
"""


@pytest.mark.timeout(120)
def test_a_profiled_survivor_runs_on_after_leaving_the_training_function() -> None:
    """Leaving the training function takes back any interrupt sent to the main thread; the way
    it is taken back must leave the interpreter as it was: under CPython 3.11 a ``NULL``
    asynchronous exception keeps the eval breaker signalled, and a profiled call (cProfile,
    coverage, a debugger) then loops at its first instruction for ever."""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", _PROFILED_AFTER_LEAVING], capture_output=True,
                          text=True, timeout=30)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "profiled"
