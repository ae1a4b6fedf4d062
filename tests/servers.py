"""Real servers for tests: an etcd v3 server on free loopback ports with its data in a temp dir.

Tests that need etcd use the ``etcd_server`` fixture (re-exported by ``tests/conftest.py``). The
server is never faked and never skipped: if ``etcd`` is not installed, the fixture fails with the
command that installs it, because the suite's setup is expected to provide it.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

ETCD_CANDIDATES = ("/usr/bin/etcd", "/usr/local/bin/etcd")
INSTALL_HINT = "install it with `apt-get install etcd-server` (Debian/Ubuntu)"


def find_etcd() -> str:
    for candidate in ETCD_CANDIDATES:
        if os.access(candidate, os.X_OK):
            return candidate
    found = shutil.which("etcd")
    if found is None:
        pytest.fail(f"etcd server binary not found; {INSTALL_HINT}", pytrace=False)
    return found


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class EtcdServer:
    """One etcd member on loopback; start/stop/restart keep the same data dir and ports."""

    def __init__(self, data_dir: Path, log_path: Path) -> None:
        self.binary = find_etcd()
        self.data_dir = data_dir
        self.log_path = log_path
        self.client_port = _free_port()
        self.peer_port = _free_port()
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def endpoint(self) -> str:
        return f"127.0.0.1:{self.client_port}"

    def start(self, timeout_s: float = 30.0) -> None:
        client_url = f"http://{self.endpoint}"
        peer_url = f"http://127.0.0.1:{self.peer_port}"
        log = self.log_path.open("ab")
        self.process = subprocess.Popen(
            [
                self.binary,
                "--name", "test",
                "--data-dir", str(self.data_dir),
                "--listen-client-urls", client_url,
                "--advertise-client-urls", client_url,
                "--listen-peer-urls", peer_url,
                "--initial-advertise-peer-urls", peer_url,
                "--initial-cluster", f"test={peer_url}",
                "--log-level", "warn",
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        log.close()
        self.wait_ready(timeout_s)

    def wait_ready(self, timeout_s: float) -> None:
        import pyetcd

        deadline = time.monotonic() + timeout_s
        while True:
            if self.process is not None and self.process.poll() is not None:
                raise RuntimeError(
                    f"etcd exited with {self.process.returncode}; see {self.log_path}"
                )
            # A fresh client per try: pyetcd benches a failed endpoint for 300 s.
            client = pyetcd.client(host="127.0.0.1", port=self.client_port, timeout=2)
            try:
                client.status()
                return
            except Exception:
                if time.monotonic() > deadline:
                    raise RuntimeError(
                        f"etcd not ready after {timeout_s} s; see {self.log_path}"
                    ) from None
                time.sleep(0.2)
            finally:
                client.close()

    def stop(self, sig: int = signal.SIGTERM) -> None:
        if self.process is None:
            return
        if self.process.poll() is None:
            self.process.send_signal(sig)
            try:
                self.process.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout=15)
        self.process = None

    def restart(self, down_s: float = 0.0) -> None:
        self.stop()
        time.sleep(down_s)
        self.start()


@pytest.fixture
def etcd_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EtcdServer]:
    """A fresh etcd v3 server on free loopback ports, its data in a temporary directory."""
    base = tmp_path_factory.mktemp("etcd")
    data_dir = base / "data"
    data_dir.mkdir(mode=0o700)
    server = EtcdServer(data_dir, base / "etcd.log")
    server.start()
    try:
        yield server
    finally:
        server.stop()
