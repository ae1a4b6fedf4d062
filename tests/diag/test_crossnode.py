"""Cross-node diagnostics: summaries exchanged through a real store, and culprits judged job-wide.

The fast tests run two :class:`ViewExchange` objects as two nodes over a real TCPStore (the store
torch's c10d rendezvous hands the agents). The slow tests run a real job of two elasticft-run
agents as two nodes with two gloo workers each (etcd-v3 rendezvous): a SIGSTOPped worker is named
with its node by the other node, whose workers only wait; a rank slowed 3x is named with its node.
"""

from __future__ import annotations

import collections
import contextlib
import os
import signal
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import psutil
import pytest
import torch.distributed as dist

from elasticft.diag import detectors as d
from elasticft.diag.exchange import HUB_KEY, ViewExchange, decode_summary, encode_summary
from elasticft.events import read_events
from tests.servers import EtcdServer
from tests.tuned_run import tuned_run

WORKER = Path(__file__).parent / "workers" / "diag_train.py"
LOOPBACK = "127.0.0.1"  # where a leader serves its hub: this host's name may not resolve
# The exchanges here run on threads of the pytest process against deadlines of 0.5-3 s; a busy
# host starves them (a stopped leader's successor took over after 6.3 s instead of 1.2 s while
# another test file ran beside this one), so scripts/test.sh runs this file alone.
pytestmark = pytest.mark.serial


def _view(rank: int, node: str, **kwargs: Any) -> d.RankView:
    return d.RankView(rank, node, **kwargs)


def test_summary_round_trip_keeps_every_field():
    view = _view(3, "b", pid=41, process_state="T", heartbeat_age_s=0.25, steps=7,
                 step_age_s=1.5, in_flight=(d.InFlight("all_reduce", 0xFFEE00112233, 12, 4.5,
                                                       "ring"),),
                 comm_seqs={0xFFEE00112233: 12, 5: 2})
    summary = decode_summary(encode_summary("b", 1, 9, [view], {3: 0.125}))
    assert (summary.node, summary.group_rank, summary.seq) == ("b", 1, 9)
    assert summary.views == (view,)
    assert summary.busy == {3: 0.125}
    with pytest.raises(ValueError, match="malformed"):
        decode_summary(b'{"v": 1, "node": "x"}')


@pytest.fixture
def store():
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                           timeout=timedelta(seconds=30))
    yield dist.PrefixStore("torch.rendezvous.job.1", server)


def gathering(exchange: ViewExchange) -> bool:
    """Whether a node reads every summary and publishes the digest now: the leader, or a
    successor acting for a silent one (the exchange's own state; nothing outside needs it)."""
    current = exchange._round
    return current is not None and (current.group_rank == 0 or exchange._acting)


def _wait(predicate, timeout_s: float = 10.0):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError("condition not met in time")


@pytest.mark.timeout(60)
def test_two_nodes_see_each_others_ranks_and_a_silent_node(store):
    a = ViewExchange(interval_s=0.2, poll_s=0.1, stale_after_s=1.0)
    b = ViewExchange(interval_s=0.2, poll_s=0.1, stale_after_s=1.0)
    try:
        a.attach(store, "a", 0, 2, hub_host=LOOPBACK)
        b.attach(store, "b", 1, 2, hub_host=LOOPBACK)
        assert [n.node for n in a.job_view().silent] == ["group rank 1"]  # nothing yet
        a.offer([_view(0, "a", steps=3), _view(1, "a", steps=3)], {0: 0.1, 1: 0.1})
        b.offer([_view(2, "b", steps=3), _view(3, "b", steps=3, comm_seqs={7: 4})],
                {2: 0.1, 3: 0.3})
        seen = _wait(lambda: a.job_view().views)
        assert [(v.rank, v.node) for v in seen] == [(2, "b"), (3, "b")]
        assert seen[1].comm_seqs == {7: 4}
        assert a.job_view().busy == {2: 0.1, 3: 0.3}
        assert a.job_view().node_of == {2: "b", 3: "b"}
        assert _wait(lambda: [(v.rank, v.node) for v in b.job_view().views]) == [(0, "a"),
                                                                                  (1, "a")]
        # b stops offering (its monitor is gone): a calls it silent, and judges none of its ranks.
        silent = _wait(lambda: a.job_view().silent, timeout_s=5)
        assert silent[0].node == "b" and silent[0].age_s > 1.0
        assert a.job_view().views == ()
        # A new round forgets the old round's views.
        a.attach(store, "a", 0, 1)
        assert a.job_view().views == () and not a.active
    finally:
        a.close()
        b.close()


@pytest.mark.timeout(60)
def test_a_newly_stopped_rank_is_published_at_once(store):
    a = ViewExchange(interval_s=30.0, poll_s=0.05)
    b = ViewExchange(interval_s=30.0, poll_s=0.05)
    try:
        a.attach(store, "a", 0, 2, hub_host=LOOPBACK)
        b.attach(store, "b", 1, 2, hub_host=LOOPBACK)
        b.offer([_view(2, "b", process_state="S")], {})
        _wait(lambda: a.job_view().views)
        # The regular interval (30 s) is far off; a stopped rank goes out at the next poll.
        b.offer([_view(2, "b", process_state="T")], {})
        states = _wait(lambda: [v.process_state for v in a.job_view().views
                                if v.process_state == "T"], timeout_s=3)
        assert states == ["T"]
    finally:
        a.close()
        b.close()


def test_single_node_or_no_store_exchanges_nothing():
    exchange = ViewExchange()
    assert exchange.job_view().views == ()
    exchange.attach(None, "a", 0, 2)
    assert not exchange.job_view().views
    exchange.attach(object(), "a", 0, 1)
    assert not exchange.active and exchange.job_view().silent == ()
    exchange.close()


# -- two real nodes -----------------------------------------------------------------------------

RDZV_CONF = "join_timeout=60,last_call_timeout=1,keep_alive_interval=1,keep_alive_max_attempt=3"


class TwoNodeJob:
    """Two elasticft-run agents ("a" and "b"), 2 gloo workers each, on one etcd."""

    def __init__(self, tmp: Path, env: dict[str, str], endpoint: str, tuning: dict[str, Any],
                 worker_flags: list[str], node_tuning: dict[str, dict[str, Any]]) -> None:
        self.tmp = tmp
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        for name in "ab":
            # Tuning constants (Python API only), for the job and for one node.
            cmd = [*tuned_run({**tuning, **node_tuning.get(name, {})}),
                   "--nnodes", "2", "--nproc-per-node", "2",
                   "--rdzv-backend", "etcd-v3", "--rdzv-endpoint", endpoint,
                   "--rdzv-id", f"diag-{tmp.name}", "--rdzv-conf", RDZV_CONF,
                   "--local-addr", "127.0.0.1", "--node-id", name,
                   "--run-dir", str(tmp / f"run-{name}"), "--max-restarts", "0",
                   "--monitor-interval", "0.1", "--shutdown-timeout", "5",
                   str(WORKER), "--state", str(tmp / "state"), *worker_flags]
            with open(tmp / f"{name}.log", "wb") as out:
                self.procs[name] = subprocess.Popen(
                    cmd, env={**env, "OMP_NUM_THREADS": "1"}, stdout=out,
                    stderr=subprocess.STDOUT, start_new_session=True)

    def events(self, node: str, kind: str) -> list[dict[str, Any]]:
        run_dir = self.tmp / f"run-{node}"
        return [e for e in read_events(run_dir) if e["kind"] == kind] if run_dir.exists() else []

    def detections(self, node: str, detector: str) -> list[dict[str, Any]]:
        return [e for e in self.events(node, "detection") if e["detector"] == detector]

    def pids(self, node: str) -> dict[int, int]:
        started = self.events(node, "workers_started")
        return {int(r): p for r, p in started[-1]["pids"].items()} if started else {}

    def output(self) -> str:
        logs = {n: (self.tmp / f"{n}.log").read_text(errors="replace") for n in self.procs}
        return "\n".join(f"--- {n} ---\n{text[-3000:]}" for n, text in logs.items())

    def wait_for(self, what: str, predicate, timeout_s: float):
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            value = predicate()
            if value:
                return value
            time.sleep(0.1)
        pytest.fail(f"{what} not seen within {timeout_s} s\n{self.output()}")

    def close(self) -> None:
        for proc in self.procs.values():
            with contextlib.suppress(psutil.NoSuchProcess):
                agent = psutil.Process(proc.pid)
                for p in [*agent.children(recursive=True), agent]:
                    with contextlib.suppress(psutil.NoSuchProcess):
                        p.send_signal(signal.SIGCONT)
                        p.send_signal(signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=30)


@pytest.fixture
def two_nodes(tmp_path: Path, job_env: dict[str, str], etcd_server: EtcdServer):
    jobs: list[TwoNodeJob] = []

    def start(tuning: dict[str, Any], worker_flags: list[str],
              node_tuning: dict[str, dict[str, Any]] | None = None) -> TwoNodeJob:
        job = TwoNodeJob(tmp_path, job_env, etcd_server.endpoint, tuning, worker_flags,
                         node_tuning or {})
        jobs.append(job)
        return job

    yield start
    for job in jobs:
        job.close()


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_stopped_worker_is_named_with_its_node_by_the_node_that_only_waits(two_nodes):
    # Node b sees its own rank stopped and would judge (and stop the job) as soon as node a;
    # its long staleness leaves the judgement to node a, which knows rank 3 only from the
    # exchange.
    job = two_nodes({"hang_multiple": 3, "hang_min_samples": 3, "hang_stacks": False},
                    ["--steps", "400", "--step-sleep", "0.05"],
                    node_tuning={"b": {"hang_heartbeat_stale_s": 120}})
    job.wait_for("steady training on both nodes",
                 lambda: all(len(job.pids(n)) == 2 for n in "ab") and
                 (job.tmp / "state").exists() and int((job.tmp / "state").read_text()) >= 25,
                 timeout_s=75)
    victim_rank, victim = max(job.pids("b").items())
    stopped_at = time.time()
    os.kill(victim, signal.SIGSTOP)
    try:
        hang = job.wait_for("node a naming the stopped rank", lambda: job.detections("a", "hang"),
                            timeout_s=30)[0]
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(victim, signal.SIGCONT)
    latency = hang["time"] - stopped_at
    print(f"node a named the stopped rank {latency:.2f} s after SIGSTOP")
    assert [(c["rank"], c["node"]) for c in hang["culprits"]] == [(victim_rank, "b")], hang
    assert f"rank {victim_rank} on b" in hang["message"]
    assert "state T" in hang["culprits"][0]["reason"]
    # Node a's own ranks only wait; the evidence has every rank's position, with its node.
    assert set(hang["ranks_waiting"]) <= set(job.pids("a"))
    nodes = {r["rank"]: r["node"] for r in hang["ranks"]}
    assert nodes == {**dict.fromkeys(job.pids("a"), "a"), **dict.fromkeys(job.pids("b"), "b")}
    stopped = next(r for r in hang["ranks"] if r["rank"] == victim_rank)
    assert stopped["state"] == "T" and stopped["view_age_s"] >= 0
    # The communicator ids agree across nodes (one process group: one key everywhere).
    assert len({comm for r in hang["ranks"] for comm in r["comm_seqs"]}) == 1
    assert latency < 10, latency


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_rank_slowed_3x_is_named_with_its_node(two_nodes):
    # Rank 3 sleeps 0.1 s more per step than the others' 0.05 s: about 3x their busy time.
    job = two_nodes({"slow_confirm_s": 2, "slow_window": 5},
                    ["--steps", "400", "--step-sleep", "0.05", "--slow-rank", "3",
                     "--slow-sleep", "0.1"])
    owner = job.wait_for("rank 3 started", lambda: next(
        (n for n in "ab" if 3 in job.pids(n)), None), timeout_s=75)
    started = job.events(owner, "workers_started")[0]["time"]
    slow = job.wait_for("a slow-rank detection", lambda: job.detections(owner, "slow_rank"),
                        timeout_s=75)[0]
    latency = slow["time"] - started
    print(f"rank 3 named slow on {owner} {latency:.1f} s after its workers started")
    assert (slow["rank"], slow["node"]) == (3, owner), slow
    assert f"slow rank 3 on {owner}" in slow["message"]
    # Compared across the job: the busy times of all four ranks, each with its node.
    assert set(slow["busy_by_rank"]) == {"0", "1", "2", "3"}
    assert set(slow["node_by_rank"].values()) == {"a", "b"}
    assert 2 < slow["ratio"] < 6, slow
    other = "b" if owner == "a" else "a"
    # The leader names it too when the rank is not its own; the other node never acts on it.
    assert not [e for e in job.detections(other, "slow_rank") if e["rank"] != 3]
    assert not job.events(owner, "failure") and not job.events(other, "failure")
    assert latency < 60, latency


class _CountingStore:
    """A real store that counts the exchange's calls to it."""

    def __init__(self, inner) -> None:
        self.inner = inner
        self.calls: list[str] = []

    def set(self, key, value):
        self.calls.append("set")
        return self.inner.set(key, value)

    def check(self, keys):
        self.calls.append(f"check{len(keys)}")
        return self.inner.check(keys)

    def get(self, key):
        self.calls.append("get")
        return self.inner.get(key)

    def multi_get(self, keys):
        self.calls.append(f"multi_get{len(keys)}")
        return self.inner.multi_get(keys)


def _steady(nodes: list[ViewExchange], window_s: float,
            offer_s: float = 0.05) -> None:
    """Every node offers its view (as its monitor does every check) for ``window_s``."""
    deadline = time.monotonic() + window_s
    while time.monotonic() < deadline:
        for group_rank, exchange in enumerate(nodes):
            exchange.offer([_view(group_rank, f"n{group_rank}", steps=3)], {group_rank: 0.1})
        time.sleep(offer_s)


@pytest.mark.timeout(90)
def test_store_calls_per_node_stay_constant_and_the_jobs_grow_with_n(store):
    """N simulated nodes, each with its own counting view of a real round store: in the steady
    state the round's store sees no call at all (everything goes through the leader's hub); on
    the hub, a node other than the leader reads one key per poll whatever N, and only the
    leader reads N keys."""
    poll_s, window_s = 0.1, 1.5
    polls = window_s / poll_s
    keys_read_per_node: dict[int, float] = {}
    for n in (4, 12):
        prefixed = dist.PrefixStore(f"size{n}", store)
        counting = [_CountingStore(prefixed) for _ in range(n)]
        nodes = [ViewExchange(interval_s=0.2, poll_s=poll_s) for _ in range(n)]
        try:
            for group_rank, exchange in enumerate(nodes):
                exchange.attach(counting[group_rank], f"n{group_rank}", group_rank, n,
                                hub_host=LOOPBACK)
            _steady(nodes, window_s=0.5)  # every key exists: the steady state
            _wait(lambda nodes=nodes, n=n: all(len(e.job_view().views) == n - 1
                                               for e in nodes))
            # Setting up: the leader wrote its hub's address, each other node read it once
            # (after a check or more while the leader had not written it yet).
            assert counting[0].calls == ["set"]
            for c in counting[1:]:
                assert c.calls[-1] == "multi_get1" and set(c.calls[:-1]) == {"check1"}, c.calls
            before = [collections.Counter(e.hub_calls) for e in nodes]
            for c in counting:
                c.calls.clear()
            _steady(nodes, window_s=window_s)
            on_hub = [e.hub_calls - b for e, b in zip(nodes, before, strict=True)]
            on_store = [list(c.calls) for c in counting]
        finally:
            for exchange in nodes:
                exchange.close()
        assert on_store == [[]] * n
        leader, others = on_hub[0], on_hub[1:]
        # The leader: one multi_get of every node's key, and its writes (summary, digest).
        assert set(leader) == {"set", f"multi_get{n}"}, leader
        for calls in others:
            # Any other node: its summary, and one read of one key (the digest) per poll.
            assert set(calls) <= {"set", "multi_get1"}, calls
            assert 0 < calls["multi_get1"] <= polls + 2, calls
            assert calls["set"] <= window_s / 0.2 + 2, calls
        keys = [sum(int(kind.removeprefix("multi_get")) * count
                    for kind, count in calls.items() if kind != "set") for calls in on_hub]
        keys_read_per_node[n] = sum(keys) / n
        # The job's keys read per poll: N (the leader) + N - 1 (one each), not N x (N - 1).
        assert sum(keys) <= 2 * n * (polls + 2), keys
    print(f"keys read per node in {window_s} s: {keys_read_per_node}")


@pytest.mark.timeout(60)
def test_a_successor_gathers_when_the_leader_is_gone_and_hands_back(store):
    nodes = [ViewExchange(interval_s=0.1, poll_s=0.05, stale_after_s=0.6, hub_retry_s=0.5)
             for _ in range(3)]
    try:
        for group_rank, exchange in enumerate(nodes):
            exchange.attach(store, f"n{group_rank}", group_rank, 3, hub_host=LOOPBACK)
        _steady(nodes, window_s=0.6)
        assert [gathering(e) for e in nodes] == [True, False, False]
        # The leader's agent is gone, its hub with it: the others exchange through the round's
        # store, where after 1 x the staleness limit group rank 1 gathers, and group rank 2
        # still sees group rank 1's ranks and learns that n0 went silent.
        nodes[0].detach()
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and not (
                [n.node for n in nodes[2].job_view().silent] == ["n0"] and
                nodes[2].job_view().views):
            for group_rank in (1, 2):
                nodes[group_rank].offer([_view(group_rank, f"n{group_rank}",
                                               process_state="T" if group_rank == 1 else None)],
                                        {})
            time.sleep(0.05)
        assert gathering(nodes[1]) and not gathering(nodes[2])
        view = nodes[2].job_view()
        assert [n.node for n in view.silent] == ["n0"] and view.silent[0].published is not False
        assert [(v.rank, v.node, v.process_state) for v in view.views] == [(1, "n1", "T")]
        # The leader is back (a new attach of the same round's store) with a new hub: the
        # others find it when they try the hub again, and group rank 1 hands back.
        nodes[0].attach(store, "n0", 0, 3, hub_host=LOOPBACK)
        _steady(nodes, window_s=1.0)
        _wait(lambda: not gathering(nodes[1]), timeout_s=5)
    finally:
        for exchange in nodes:
            exchange.close()


_LEADER_PROCESS = """
import sys, time
from datetime import timedelta
import torch.distributed as dist
from elasticft.diag.detectors import RankView
from elasticft.diag.exchange import ViewExchange
store = dist.PrefixStore(sys.argv[2], dist.TCPStore(
    "127.0.0.1", int(sys.argv[1]), is_master=False, timeout=timedelta(seconds=30)))
leader = ViewExchange(interval_s=0.1, poll_s=0.05, stale_after_s=2.0)
leader.attach(store, "n0", 0, 3, hub_host="127.0.0.1")
while True:
    leader.offer([RankView(0, "n0", steps=1)], {})
    time.sleep(0.05)
"""


@pytest.mark.timeout(120)
def test_a_stopped_leaders_hub_costs_nobody_a_hang(job_env: dict[str, str]):
    """The leader is a process of its own, SIGSTOPped: its hub then answers nothing, and a
    TCPStore client would wait for it forever. The others' hub calls end at their deadline;
    they exchange through the round's store, where group rank 1 gathers and group rank 2
    sees its ranks and the leader's node silent. Continued, the leader leads again."""
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                           timeout=timedelta(seconds=30))
    store = dist.PrefixStore("round.7", server)
    leader = subprocess.Popen([sys.executable, "-c", _LEADER_PROCESS, str(server.port),
                               "round.7"], env=job_env)
    # Deadlines wide enough for a loaded machine's scheduling; what is judged is who gathers.
    nodes = [ViewExchange(interval_s=0.1, poll_s=0.05, stale_after_s=2.0, hub_timeout_s=1.0,
                          hub_retry_s=60.0) for _ in range(2)]
    try:
        for group_rank, exchange in enumerate(nodes, start=1):
            exchange.attach(store, f"n{group_rank}", group_rank, 3, hub_host=LOOPBACK)

        def offer() -> None:
            for group_rank, exchange in enumerate(nodes, start=1):
                exchange.offer([_view(group_rank, f"n{group_rank}",
                                      process_state="T" if group_rank == 1 else None)], {})

        def sees(*ranks: int) -> bool:
            offer()
            return sorted(v.rank for v in nodes[1].job_view().views) == list(ranks)

        store.wait([HUB_KEY], timedelta(seconds=60))  # the leader's process is up (torch)
        _wait(lambda: sees(0, 1), timeout_s=20)  # through the leader's digest on its hub
        assert nodes[1].hub_calls["multi_get1"] > 0
        os.kill(leader.pid, signal.SIGSTOP)
        stopped_at = time.monotonic()
        _wait(lambda: sees(1) and gathering(nodes[0]), timeout_s=30)
        print(f"group rank 1 gathers {time.monotonic() - stopped_at:.2f} s after the stop")
        view = nodes[1].job_view()
        assert [n.node for n in view.silent] == ["n0"]
        assert [(v.rank, v.node, v.process_state) for v in view.views] == [(1, "n1", "T")]
        assert not gathering(nodes[1])
        # The leader goes on: the overdue calls answer, the connections kept are in step, and
        # group rank 1 hands back.
        os.kill(leader.pid, signal.SIGCONT)
        _wait(lambda: sees(0, 1) and not gathering(nodes[0]), timeout_s=30)
    finally:
        for exchange in nodes:
            exchange.close()
        os.kill(leader.pid, signal.SIGCONT)
        leader.kill()
        leader.wait()


@pytest.mark.timeout(60)
def test_a_new_rounds_group_rank_0_leads_whoever_led_before(store):
    a = ViewExchange(interval_s=0.1, poll_s=0.05)
    b = ViewExchange(interval_s=0.1, poll_s=0.05)
    try:
        for round_, (rank_a, rank_b) in enumerate([(0, 1), (1, 0)], start=1):
            round_store = dist.PrefixStore(f"round.{round_}", store)
            a.attach(round_store, "a", rank_a, 2, hub_host=LOOPBACK)
            b.attach(round_store, "b", rank_b, 2, hub_host=LOOPBACK)
            a.offer([_view(0, "a", steps=round_)], {})
            b.offer([_view(1, "b", steps=round_)], {})
            seen = _wait(lambda: a.job_view().views and b.job_view().views and
                         (a.job_view().views, b.job_view().views))
            assert (gathering(a), gathering(b)) == (rank_a == 0, rank_b == 0)
            assert [(v.rank, v.steps) for v in seen[0]] == [(1, round_)]
            assert [(v.rank, v.steps) for v in seen[1]] == [(0, round_)]
    finally:
        a.close()
        b.close()
