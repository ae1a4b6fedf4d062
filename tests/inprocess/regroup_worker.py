"""A worker of test_inprocess_groups.py: joins a gloo group with the script's own settings,
fails once in generation 0 (rank 1 raises a connection error), recovers in process on the
generation the test publishes, then checks what the regrouped group kept.

argv: rank, store port, in-process directory, result file, scenario (``timeout``).
"""

from __future__ import annotations

import json
import os
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from elasticft.inprocess import InProcess
from elasticft.inprocess.protocol import InProcessSettings


def main() -> None:
    rank, port, directory, result = (int(sys.argv[1]), int(sys.argv[2]), Path(sys.argv[3]),
                                     Path(sys.argv[4]))
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=60))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2,
                            timeout=timedelta(seconds=5))
    recovery = InProcess(InProcessSettings(directory=directory, local_rank=rank, timeout_s=60))
    entries = []

    def train() -> None:
        entries.append(time.time())
        if len(entries) == 1:
            if rank == 1:
                raise ConnectionResetError("injected: connection reset by peer")
            dist.all_reduce(torch.ones(1))  # raises once rank 1 ends its group
            return
        if rank == 1:  # alive, but never meets rank 0 again: a hang
            time.sleep(120)
            return
        started = time.monotonic()
        try:
            dist.all_reduce(torch.ones(1))
            error = ""
        except RuntimeError as e:
            error = str(e)
        result.write_text(json.dumps({"error": error, "waited_s": time.monotonic() - started,
                                      "recoveries": recovery.recoveries}))
        os._exit(0)

    recovery.run(train)


if __name__ == "__main__":
    main()
