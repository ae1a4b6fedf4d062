"""The news of an ended generation across nodes (:mod:`elasticft.inprocess.failure_news`): the pure
choice of a waiting agent, and two agents' sides on a real TCPStore (the round's store as two
nodes see it): one ends the generation, the other hears it at once, both agree on one next
generation; with a node that never counts itself in, both take the next rendezvous round."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path

import pytest
import torch.distributed as dist

from elasticft.events import EventLog, failures_heard_lines, read_events
from elasticft.inprocess.failure_news import FailureNews, NextGeneration, next_move


@pytest.mark.timeout(30)
@pytest.mark.parametrize(("counted", "nodes", "waited_s", "kind", "why"), [
    (2, 2, 0.0, "host", "all 2 nodes"),
    (3, 2, 0.0, "host", "all 2 nodes"),  # a late count of a node from before: still in
    (1, 2, 0.1, "wait", "1 of 2"),
    (1, 2, 5.0, "round", "a node is lost"),
    (0, 3, 9.0, "round", "0 of 3"),
    (2, 2, 9.0, "host", "all 2 nodes"),  # everyone in, however late
    (1, 2, 0.4, "round", "refused"),  # gone on evidence: no need to wait for the limit
    (2, 2, 0.4, "host", "all 2 nodes"),  # a refusal seen before its node came in: it is in
])
def test_what_a_waiting_agent_does(counted: int, nodes: int, waited_s: float, kind: str,
                                   why: str) -> None:
    gone = ("agent of node rank 1 is gone: its control endpoint refused the connection",) \
        if why == "refused" or waited_s == 0.4 else ()
    move = next_move(counted=counted, nodes=nodes, waited_s=waited_s, limit_s=5.0, gone=gone)
    assert move.kind == kind and why in move.reason


@pytest.fixture
def store_server() -> dist.TCPStore:
    return dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                         timeout=timedelta(seconds=30))


def _news(server: dist.TCPStore, tmp_path: Path, node: str, nodes: int,
          heard: Callable[[object], None], limit_s: float = 5.0, rank: int = 0
          ) -> FailureNews:
    client = dist.TCPStore("127.0.0.1", server.port, is_master=False,
                           timeout=timedelta(seconds=30))
    news = FailureNews(EventLog(tmp_path / "events", node), node, heard, limit_s)
    news.on_rendezvous(dist.PrefixStore("torch.rendezvous.job.0", client), 0, nodes,
                       rank, "127.0.0.1")
    return news


def _wait(what: str, check: Callable[[], object], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


@pytest.mark.timeout(60)
def test_every_node_hears_and_the_nodes_agree_on_one_generation(
        store_server: dist.TCPStore, tmp_path: Path) -> None:
    interrupted = threading.Event()
    a = _news(store_server, tmp_path, "a", 2, lambda _ended: interrupted.set())
    b = _news(store_server, tmp_path, "b", 2, lambda _ended: pytest.fail("b heard itself"),
              rank=1)
    try:
        ended = b.publish_ended("rank 3 died")
        assert ended.node == "b" and ended.index == 0
        _wait("node a's interrupt", interrupted.is_set)
        heard = a.heard()
        assert heard is not None and heard[0] == ended
        assert b.heard() is None  # its own news: b acts on it through its own decision
        agreed: dict[str, NextGeneration] = {}
        hosts: list[str] = []

        def agree(news: FailureNews) -> None:
            def host() -> tuple[str, int]:
                hosts.append(news.node_id)
                return "127.0.0.1", 1000 + len(hosts)

            agreed[news.node_id] = news.agree(host)

        threads = [threading.Thread(target=agree, args=(n,)) for n in (a, b)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(20)
        assert agreed["a"] == agreed["b"] and not agreed["a"].round, agreed
        assert agreed["a"].host in hosts
        for news in (a, b):
            news.done()
        assert a.heard() is None and a.index == b.index == 1
        events = [e for e in read_events(tmp_path / "events") if e["kind"] == "failure_heard"]
        assert {e["node"]: e["source"] for e in events} == {"a": "b", "b": "b"}
        assert all(e["after_s"] >= 0 for e in events)
        # The next failure is the next index's, heard again.
        interrupted.clear()
        b.publish_ended("rank 2 died")
        _wait("node a's second interrupt", interrupted.is_set)
        assert a.heard() is not None and a.heard()[0].index == 1
    finally:
        a.close()
        b.close()


@pytest.mark.timeout(60)
def test_a_node_that_never_counts_itself_in_sends_everyone_to_the_next_round(
        store_server: dist.TCPStore, tmp_path: Path) -> None:
    a = _news(store_server, tmp_path, "a", 2, lambda _ended: None, limit_s=0.3)
    try:
        a.publish_ended("every worker caught a communication error")
        agreed = a.agree(lambda: pytest.fail("no host without every node"))
        assert agreed.round and "a node is lost" in agreed.reason
    finally:
        a.close()


@pytest.mark.timeout(60)
def test_a_node_whose_agent_is_gone_sends_everyone_to_the_next_round_at_once(
        store_server: dist.TCPStore, tmp_path: Path) -> None:
    """Node b's agent wrote its control endpoint and died (its endpoint closed): a's probe is
    refused, and a does not wait for the limit."""
    a = _news(store_server, tmp_path, "a", 2, lambda _ended: None, limit_s=60.0)
    b = _news(store_server, tmp_path, "b", 2, lambda _ended: None, rank=1)
    try:
        b.close()
        a.publish_ended("every worker caught a communication error")
        agreed = a.agree(lambda: pytest.fail("no host without every node"))
        assert agreed.round and "refused" in agreed.reason, agreed
    finally:
        a.close()


@pytest.mark.timeout(30)
def test_the_report_says_who_heard_first_and_how_long_after_the_others_did() -> None:
    def heard(node: str, source: str, at: float, after: float, index: int = 0) -> dict:
        return {"kind": "failure_heard", "node": node, "source": source, "round": 2,
                "index": index, "heard": at, "after_s": after, "cause": "rank 3 died"}

    events = [heard("b", "b", 10.0, 0.0), heard("a", "b", 10.012, 0.012),
              heard("a", "a", 20.0, 0.0, 1), {"kind": "decision"}]
    found, text = failures_heard_lines(events)
    assert len(found) == 3
    assert text.splitlines()[0] == ("failure heard (round 2, recovery 0) from node b: b (first), "
                                    "a after 0.012 s; cause: rank 3 died")
    assert "(round 2, recovery 1) from node a: a (first)" in text
    assert failures_heard_lines([{"kind": "decision"}]) == (
        [], "failure heard across nodes: none")
