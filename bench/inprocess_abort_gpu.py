"""What one GPU allows of in-process recovery on NCCL: an NCCL group aborted while a kernel is
pending, the abort within the hard limit, the device's health check, a new group.

One process, a one-rank NCCL group on GPU 0: a long kernel (``torch.cuda._sleep``) is queued
on the current stream and an ``all_reduce`` behind it, so the collective is pending when the
monitor's path ends the groups (:func:`elasticft.recovery.groups.end_groups`, NCCL's
``_abort_process_group``). It prints one line per check and exits 1 when one fails:

    python bench/inprocess_abort_gpu.py [--limit-s 30] [--sleep-cycles 2000000000]
    python bench/inprocess_abort_gpu.py --dry-run    # no CUDA: checks the imports only
"""

from __future__ import annotations

import argparse
import sys
import time
from datetime import timedelta
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch
import torch.distributed as dist

from elasticft.recovery.groups import destroy_registered, end_groups
from elasticft.recovery.health import device_health, within
from elasticft.recovery.ncclenv import abort_warning, nccl_version


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--limit-s", type=float, default=30.0, help="the teardown's hard limit")
    parser.add_argument("--sleep-cycles", type=int, default=2_000_000_000)
    parser.add_argument("--dry-run", action="store_true")
    args = parser.parse_args()
    if args.dry_run or not torch.cuda.is_available():
        print("inprocess_abort_gpu: dry run (no CUDA device or --dry-run): imports checked; "
              "nothing measured")
        return 0
    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    version = nccl_version()
    print(f"nccl {version}: {abort_warning(version) or 'abort not known to be broken'}")
    ok = True
    for attempt in (1, 2):
        store = dist.TCPStore("127.0.0.1", 0, 1, True)  # a store of each group's own
        dist.init_process_group("nccl", store=store, rank=0, world_size=1, device_id=device,
                                timeout=timedelta(seconds=max(60, 2 * args.limit_s)))
        x = torch.ones(1 << 20, device=device)
        dist.all_reduce(x)  # the communicator is up
        torch.cuda.synchronize()
        torch.cuda._sleep(args.sleep_cycles)  # a long kernel, then a collective behind it
        dist.all_reduce(x, async_op=True)
        started = time.perf_counter()
        finished, error = within(lambda: end_groups("nccl"), args.limit_s)
        abort_s = time.perf_counter() - started
        print(f"attempt {attempt}: abort with a pending kernel "
              f"{'returned' if finished else 'DID NOT RETURN'} in {abort_s:.3f} s "
              f"(limit {args.limit_s:.0f} s){f', error {error!r}' if error else ''}")
        ok &= finished
        with_destroy, _ = within(destroy_registered, args.limit_s)  # the abort cleared it
        started = time.perf_counter()
        sick = device_health(args.limit_s)
        print(f"attempt {attempt}: destroy {'done' if with_destroy else 'HUNG'}; health check "
              f"{'passed' if sick is None else 'FAILED: ' + sick} in "
              f"{time.perf_counter() - started:.3f} s")
        ok &= with_destroy and sick is None
    print(f"a new group formed after the abort: {'yes' if ok else 'no'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
