"""The suite's etcd server: a first start whose port another process took after it was found
free starts on other ports, so a busy machine's port churn fails no test at its set-up."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from tests.servers import EtcdServer


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_port_taken_before_the_first_start_moves_the_server_to_another(tmp_path: Path) -> None:
    (tmp_path / "data").mkdir(mode=0o700)
    server = EtcdServer(tmp_path / "data", tmp_path / "etcd.log")
    taken = server.client_port
    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", taken))
        squatter.listen()
        server.start()
        try:
            moved = server.client_port
            assert moved != taken
            assert "address already in use" in (tmp_path / "etcd.log").read_text()
            server.restart()  # a restart keeps the ports its clients know
            assert server.client_port == moved
        finally:
            server.stop()
