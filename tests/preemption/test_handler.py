"""The preemption add-on in the agent's process: it never holds up the launch for a probe, takes
SIGTERM as a notice only inside a Kubernetes pod (and not under Slurm), and ends the run as
preempted with exit code 75 after the save."""

from __future__ import annotations

import dataclasses
import signal
import socket
import threading
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import pytest

from elasticft.addon.api import AddOnContext, GroupInfo, StopRun
from elasticft.config import ElasticftConfig, PreemptConfig
from elasticft.events import EventLog, read_events
from elasticft.preemption import PREEMPTED_EXIT_CODE
from elasticft.preemption.handler import PreemptionAddOn, PreemptionHandler


def _context(config: PreemptConfig, env: dict[str, str], events: EventLog | None = None
             ) -> AddOnContext:
    return AddOnContext(ElasticftConfig(preempt=config),
                        SimpleNamespace(local_addr=None), env, events)  # type: ignore[arg-type]


@pytest.fixture
def silent_endpoint() -> Iterator[str]:
    """An address that accepts connections (the kernel's backlog) and never answers."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(8)
        yield f"http://127.0.0.1:{listener.getsockname()[1]}"


@pytest.fixture
def torch_like_term_handler() -> Iterator[None]:
    before = signal.getsignal(signal.SIGTERM)

    def torch_handler(signum: int, frame: object) -> None:
        raise AssertionError("torch's handler ran")

    signal.signal(signal.SIGTERM, torch_handler)
    yield
    signal.signal(signal.SIGTERM, before)


def _probing() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith("elasticft-preempt")]


@pytest.mark.timeout(60)
def test_the_launch_does_not_wait_for_an_endpoint_that_does_not_answer(
        silent_endpoint: str) -> None:
    config = PreemptConfig(preempt_notices=silent_endpoint, preempt_probe_timeout_s=30.0)
    handler = PreemptionAddOn().build(_context(config, {}), {"ckpt": None, "slurm": None})
    assert handler is not None and handler.watcher is not None
    try:
        # Built, and so the agent goes on, while every probe still waits for its answer.
        assert len(_probing()) == 3 and handler.watcher.watching == []
    finally:
        handler.close()


def test_off_builds_nothing() -> None:
    assert PreemptionAddOn().build(_context(PreemptConfig(preempt_notices="off"), {}),
                                   {"ckpt": None, "slurm": None}) is None


def _group(run_dir: Path) -> GroupInfo:
    return GroupInfo(run_id="r", node_id="n0", run_dir=run_dir, round=0, group_rank=0,
                     group_world_size=1, restart_count=0, workers=())


@pytest.mark.timeout(60)
@pytest.mark.parametrize(("env", "slurm", "takes_sigterm"), [
    ({"KUBERNETES_SERVICE_HOST": "10.96.0.1"}, None, True),
    ({}, None, False),  # outside Kubernetes SIGTERM is torch's, as under torchrun
    ({"KUBERNETES_SERVICE_HOST": "10.96.0.1"}, object(), False),  # Slurm's: a cancel
])
def test_sigterm_is_a_notice_only_in_a_pod(
        env: dict[str, str], slurm: object, takes_sigterm: bool, tmp_path: Path,
        torch_like_term_handler: None, silent_endpoint: str) -> None:
    events = EventLog(tmp_path, "n0")
    config = PreemptConfig(preempt_notices=silent_endpoint, preempt_grace_s=45)
    handler = PreemptionAddOn().build(_context(config, env, events),
                                      {"ckpt": None, "slurm": slurm})  # type: ignore[dict-item]
    assert isinstance(handler, PreemptionHandler)
    torch_handler = signal.getsignal(signal.SIGTERM)
    group = _group(tmp_path)
    try:
        handler.on_workers_started(group)
        assert (signal.getsignal(signal.SIGTERM) is not torch_handler) is takes_sigterm
        if not takes_sigterm:
            return
        signal.raise_signal(signal.SIGTERM)
        # Recorded only; a second SIGTERM would be torch's again.
        assert signal.getsignal(signal.SIGTERM) is torch_handler
        with pytest.raises(StopRun) as stop:
            handler.check(group)
        assert (stop.value.state, stop.value.exit_code) == ("preempted", PREEMPTED_EXIT_CODE)
        handler.check(group)  # acted once
    finally:
        handler.close()
        events.close()
    found = {e["kind"]: e for e in read_events(tmp_path)}
    assert found["preemption_notice"]["provider"] == "kubernetes"
    assert "grace period 45 s" in found["preemption_notice"]["detail"]
    assert found["preemption_decision"]["action"] == "save_and_stop"
    assert found["preemption_saved"]["durable"] is True  # no worker to wait for


def test_the_step_time_and_the_snapshots_age_come_from_the_first_ranks_records(
        tmp_path: Path) -> None:
    from elasticft.addon.api import WorkerInfo
    from elasticft.preemption.handler import _step_timing
    from elasticft.steps import step_log_path

    path = step_log_path(tmp_path, 4)
    path.parent.mkdir(parents=True)
    path.write_text("".join(f'{{"time": {100 + 0.5 * s}, "step": {s}}}\n' for s in range(1, 9))
                    + '{"time": 1')  # a torn last line
    group = dataclasses.replace(_group(tmp_path), workers=(
        WorkerInfo(1, 5, 8, 11), WorkerInfo(0, 4, 8, 10)))
    assert _step_timing(group, 6, now=110.0) == (pytest.approx(0.5), pytest.approx(7.0))
    assert _step_timing(group, None, now=110.0) == (pytest.approx(0.5), None)
    assert _step_timing(_group(tmp_path), 6, now=110.0) == (None, None)  # no workers


@pytest.mark.timeout(60)
@pytest.mark.parametrize(("elastic", "min_nodes", "others_stop"), [
    (False, 2, True),  # static: the job cannot go on without the preempted node
    (True, 2, True),  # elastic, but 2 nodes are the least it runs on
    (True, 1, False),  # elastic with room: the others go on; the departure is a node loss
])
def test_a_preempted_node_tells_the_others_of_its_round(
        elastic: bool, min_nodes: int, others_stop: bool, tmp_path: Path) -> None:
    from datetime import timedelta

    from torch.distributed import PrefixStore, TCPStore

    from elasticft.addon.savenow import SaveBeforeExit
    from elasticft.preemption.notices import Notice

    server = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                      timeout=timedelta(seconds=10))
    nodes = {}
    for rank, name in enumerate(("a", "b")):
        store = PrefixStore("round-3/", TCPStore("127.0.0.1", server.port, is_master=False,
                                                  timeout=timedelta(seconds=10)))
        events = EventLog(tmp_path / name, name)
        handler = PreemptionHandler(PreemptConfig(preempt_poll_s=0.1),
                                    saver=SaveBeforeExit(None), events=events, elastic=elastic,
                                    min_nodes=min_nodes, node_id=name)
        group = dataclasses.replace(_group(tmp_path / name), node_id=name, group_rank=rank,
                                    group_world_size=2, round=3)
        handler.on_rendezvous(group, store)
        nodes[name] = (handler, group, events)
    a, b = nodes["a"], nodes["b"]
    b[0].check(b[1])  # nothing yet
    a[0].notify(Notice("gcp", "termination", a[0].wall_clock() + 30, "instance/preempted TRUE"))
    with pytest.raises(StopRun):
        a[0].check(a[1])
    try:
        def b_acts() -> bool:
            try:
                b[0].check(b[1])
            except StopRun as stop:
                assert (stop.state, stop.exit_code) == ("preempted", PREEMPTED_EXIT_CODE)
                return True
            return any(e["kind"] == "preemption_decision" for e in read_events(tmp_path / "b"))

        from tests.agent.test_launch import wait_until

        wait_until(b_acts, 30, "node b to hear of node a's notice")
    finally:
        for handler, _, events in nodes.values():
            handler.close()
            events.close()
    decision = next(e for e in read_events(tmp_path / "b") if e["kind"] == "preemption_decision")
    assert decision["facts"]["from_node"] == "a"
    assert decision["action"] == ("save_and_stop" if others_stop else "continue")
