"""A restart of one node's workers forms their group again: under the static rendezvous
(``--master-port`` given) the restarted workers get a store of their own, not the static
rendezvous's one store, where they would read their peers' addresses of the attempt before; a
launch that names no port is the local c10d rendezvous on every torch (torch 2.10 and 2.11
default the port to 29500, which kept it static). Real gloo workers, a real SIGKILL."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from elasticft.events import read_events
from tests.conftest import BIN, free_port

pytestmark = [pytest.mark.timeout(240), pytest.mark.smoke]
WORKER = Path(__file__).parent / "workers" / "regroup_after_kill.py"


@pytest.mark.parametrize("port_given", [True, False], ids=["static", "no-port"])
def test_a_restart_forms_the_group_again(port_given: bool, tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    port = ["--master-port", str(free_port())] if port_given else []
    done = subprocess.run(
        [str(BIN / "elasticft-run"), "--nproc-per-node", "2", "--max-restarts", "1", *port,
         "--run-dir", str(run_dir), str(WORKER)],
        capture_output=True, text=True, timeout=200)
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-3000:]
    for attempt in (0, 1):
        for rank in (0, 1):
            assert f"grouped {attempt} {rank}" in output, output[-3000:]
    events = read_events(run_dir)
    backend = "static" if port_given else "c10d"
    assert [e["rdzv_backend"] for e in events if e["kind"] == "run_start"] == [backend]
    ports = [e["master_port"] for e in events if e["kind"] == "rendezvous"]
    assert len(ports) == 2 and ports[0] != ports[1], ports
