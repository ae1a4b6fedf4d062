"""A node is known gone on evidence: only a refused connection to its agent's control endpoint
ends its membership early; an answer or no answer leaves it to the lease (a table, and real
sockets)."""

from __future__ import annotations

import socket

import pytest

from elasticft.rendezvous.liveness import (
    ControlEndpoint,
    Evidence,
    Liveness,
    Probe,
    judge,
    probe,
)


@pytest.mark.parametrize(("evidence", "dead", "words"), [
    (Evidence("b", Probe.REFUSED, "10.0.0.2:4000"), True, "refused the connection"),
    (Evidence("b", Probe.ANSWERED, "10.0.0.2:4000"), False, "alive, only late"),
    (Evidence("b", Probe.NO_ANSWER, "10.0.0.2:4000"), False, "its lease decides"),
    (Evidence("b", Probe.NO_ANSWER), False, "its lease decides"),
])
@pytest.mark.timeout(10)
def test_judge(evidence: Evidence, dead: bool, words: str) -> None:
    verdict = judge(evidence)
    assert (verdict.kind is Liveness.DEAD) is dead
    assert words in verdict.reason and "node b" in verdict.reason


@pytest.mark.timeout(30)
def test_a_live_endpoint_answers_and_a_closed_one_refuses() -> None:
    endpoint = ControlEndpoint("127.0.0.1")
    assert endpoint.endpoint.startswith("127.0.0.1:")
    # More than its backlog: every connection is accepted and closed. The wait is generous so a
    # loaded machine, whose accepting thread may not run for a while, cannot fail it.
    for _ in range(100):
        assert probe(endpoint.endpoint, timeout_s=10.0) is Probe.ANSWERED
    address = endpoint.endpoint
    endpoint.close()
    assert probe(address) is Probe.REFUSED


@pytest.mark.timeout(30)
def test_a_port_nobody_listens_on_refuses_and_a_malformed_endpoint_is_no_answer() -> None:
    assert probe("no-port") is Probe.NO_ANSWER
    with socket.socket() as unused:
        unused.bind(("127.0.0.1", 0))
        port = unused.getsockname()[1]
    assert probe(f"127.0.0.1:{port}") is Probe.REFUSED
