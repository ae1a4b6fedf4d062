"""A full /dev/shm (checkpoints live there too) turns diagnostics off for that rank, one line
each, and never kills the agent or the worker with SIGBUS; a checkpoint slot that cannot be
reserved fails that save with one line. A real tmpfs of one page, in a user and mount namespace.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.diag.test_shim_real_nccl import mount_namespaces_work, run_in_mount_namespace

ROOT = Path(__file__).resolve().parents[2]

# The agent creates the rings, then the worker connects; with the pages unreserved, the
# worker's first records past the first page would raise SIGBUS. Then a checkpoint slot.
SCRIPT = textwrap.dedent("""
    import os, sys
    from pathlib import Path
    from elasticft.ckpt.api import StorageFull
    from elasticft.ckpt.memory.slot import Slot
    from elasticft.diag.ring import create_anonymous_ring
    from elasticft.worker import init

    directory = Path(sys.argv[1])
    # The agent's rings have no name, but the tmpfs still bounds them.
    print("anonymous", create_anonymous_ring(directory, 0, "nccl"), flush=True)
    handle = init(env={"ELASTICFT_DIAG_RING_DIR": str(directory), "RANK": "0"})
    if handle.recorder is not None:
        for i in range(10000):
            handle.recorder.writer.append(1, enqueue_ns=i + 1)
    print("recording", handle.recorder is not None, flush=True)
    try:
        Slot.create_or_grow(directory / "ckpt-s0", 1 << 20)
    except StorageFull as e:
        print("save failed:", e, file=sys.stderr, flush=True)
    print("survived", sorted(os.listdir(directory)), flush=True)
""")


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_full_shm_turns_recording_off_with_one_line_and_the_process_survives(tmp_path):
    if not mount_namespaces_work():
        pytest.skip("needs unprivileged user and mount namespaces (unshare -rm) for a full tmpfs")
    full = tmp_path / "full"
    full.mkdir()
    env = {"PYTHONPATH": os.environ.get("PYTHONPATH", str(ROOT))}
    command = run_in_mount_namespace([sys.executable, "-c", SCRIPT, str(full)], env,
                                     f"mount -t tmpfs -o size=4k tmpfs {full}")
    result = subprocess.run(command, capture_output=True, text=True, timeout=100, cwd=ROOT)
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == [
        "anonymous None", "recording False",
        # A slot is allocated under a temporary name: one that does not fit leaves nothing.
        "survived []",
    ]
    lines = result.stderr.splitlines()
    assert len(lines) == 3, lines
    rings = [line for line in lines if "diagnostics ring" in line]
    assert len(rings) == 2 and all("No space left on device" in line for line in rings)
    assert "records no nccl diagnostics" in rings[0]
    assert "records no Python diagnostics" in rings[1]
    assert lines[2].startswith("save failed: shared memory") and "cannot grow" in lines[2]
