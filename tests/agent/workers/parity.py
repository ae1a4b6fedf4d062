"""The failures of the launcher parity table (tests/agent/test_launch_parity.py), the same code
run as a script (``parity.py CASE``) and as a function entrypoint (``main(CASE)``).

Rank 1 fails once the group has formed: ``user_error`` raises on every attempt; ``kill``
(SIGKILL) and ``hang`` (SIGSTOP while rank 0 waits in an all-reduce) on the first attempt
only, so the restarted group finishes. ``repeat`` raises in elasticft-independent code before
any step, on every attempt.
"""

from __future__ import annotations

import os
import signal
import sys

import torch
import torch.distributed as dist


def load_data() -> None:
    raise RuntimeError("the data set is empty")


def main(case: str) -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    first = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
    t = torch.ones(1)
    dist.all_reduce(t)
    if rank == 1 and case == "user_error":
        raise ValueError("bad config value")
    if rank == 1 and case == "kill" and first:
        os.kill(os.getpid(), signal.SIGKILL)
    if rank == 1 and case == "hang" and first:
        os.kill(os.getpid(), signal.SIGSTOP)
    if case == "repeat":
        load_data()
    for _ in range(3):
        dist.all_reduce(t)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
