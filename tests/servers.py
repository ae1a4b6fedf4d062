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
import threading
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
    """One etcd member on loopback; start/stop/restart keep the same data dir and ports.

    Alone it is a one-member cluster; :class:`EtcdCluster` sets ``initial_cluster`` to make it
    one member of several."""

    def __init__(self, data_dir: Path, log_path: Path, name: str = "test") -> None:
        self.binary = find_etcd()
        self.name = name
        self.data_dir = data_dir
        self.log_path = log_path
        self.client_port = _free_port()
        self.peer_port = _free_port()
        self.initial_cluster = f"{name}={self.peer_url}"
        self.process: subprocess.Popen[bytes] | None = None
        self._served = False
        """Whether it has answered once: its ports are known to its clients from then on."""

    @property
    def endpoint(self) -> str:
        return f"127.0.0.1:{self.client_port}"

    @property
    def peer_url(self) -> str:
        return f"http://127.0.0.1:{self.peer_port}"

    def start(self, timeout_s: float = 30.0, wait: bool = True) -> None:
        """Starts etcd and waits until it answers. A first start of a one-member server whose
        port another process took since :func:`_free_port` found it free (etcd exits with
        "address already in use") tries again on other ports, on an empty data directory."""
        for attempt in range(3):
            self._launch()
            if not wait:
                return
            try:
                self.wait_ready(timeout_s)
                self._served = True
                return
            except RuntimeError:
                if attempt == 2 or not self._port_taken_before_first_serve():
                    raise
            shutil.rmtree(self.data_dir, ignore_errors=True)
            self.data_dir.mkdir(mode=0o700)
            self.client_port, self.peer_port = _free_port(), _free_port()
            self.initial_cluster = f"{self.name}={self.peer_url}"

    def _port_taken_before_first_serve(self) -> bool:
        alone = self.initial_cluster == f"{self.name}={self.peer_url}"
        log = self.log_path.read_text(errors="replace") if self.log_path.exists() else ""
        return alone and not self._served and "address already in use" in log[-2000:]

    def _launch(self) -> None:
        client_url = f"http://{self.endpoint}"
        log = self.log_path.open("ab")
        self.process = subprocess.Popen(
            [
                self.binary,
                "--name", self.name,
                "--data-dir", str(self.data_dir),
                "--listen-client-urls", client_url,
                "--advertise-client-urls", client_url,
                "--listen-peer-urls", self.peer_url,
                "--initial-advertise-peer-urls", self.peer_url,
                "--initial-cluster", self.initial_cluster,
                "--log-level", "warn",
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        log.close()

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


class EtcdCluster:
    """Several etcd members on loopback forming one cluster (a member per process, each with
    its own data dir, as on separate hosts)."""

    def __init__(self, base: Path, size: int = 3) -> None:
        self.members = []
        for i in range(size):
            data_dir = base / f"m{i}"
            data_dir.mkdir(mode=0o700)
            self.members.append(EtcdServer(data_dir, base / f"m{i}.log", name=f"m{i}"))
        cluster = ",".join(f"{m.name}={m.peer_url}" for m in self.members)
        for member in self.members:
            member.initial_cluster = cluster

    @property
    def endpoint(self) -> str:
        """Every member's client address, as ``--rdzv-endpoint`` takes them."""
        return ",".join(m.endpoint for m in self.members)

    def start(self, timeout_s: float = 60.0) -> None:
        for member in self.members:  # a member waits for the others to form a quorum
            member.start(wait=False)
        for member in self.members:
            member.wait_ready(timeout_s)
        self.leader(timeout_s)

    def leader(self, timeout_s: float = 30.0) -> EtcdServer:
        """The member that leads now (once one is elected)."""
        import pyetcd

        deadline = time.monotonic() + timeout_s
        while True:
            for member in self.members:
                if member.process is None:
                    continue
                client = pyetcd.client(host="127.0.0.1", port=member.client_port, timeout=2)
                try:
                    leader = client.status().leader
                    if leader is not None:
                        return next(m for m in self.members if m.name == leader.name)
                except Exception:
                    pass
                finally:
                    client.close()
            if time.monotonic() > deadline:
                raise RuntimeError(f"no etcd leader after {timeout_s} s")
            time.sleep(0.2)

    def stop(self) -> None:
        for member in self.members:
            member.stop()


@pytest.fixture
def etcd_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EtcdCluster]:
    """A fresh 3-member etcd cluster on free loopback ports."""
    cluster = EtcdCluster(tmp_path_factory.mktemp("etcd-cluster"))
    cluster.start()
    try:
        yield cluster
    finally:
        cluster.stop()


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


@pytest.fixture
def echo_server() -> Iterator[tuple[str, int]]:
    """A small TCP echo server on this host, one thread per client: a script's own service."""
    server = socket.create_server(("127.0.0.1", 0))
    server.settimeout(0.5)  # how soon it sees the stop
    stop = threading.Event()

    def serve() -> None:
        while not stop.is_set():
            try:
                conn, _ = server.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            conn.settimeout(None)
            threading.Thread(target=_echo, args=(conn,), daemon=True).start()

    threading.Thread(target=serve, daemon=True).start()
    yield server.getsockname()
    stop.set()
    server.close()


def _echo(conn: socket.socket) -> None:
    with conn:
        while data := conn.recv(1024):
            conn.sendall(data)
