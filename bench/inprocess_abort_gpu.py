"""What one GPU allows of in-process recovery on NCCL: the device health check on the rank's
device from its helper thread, an NCCL group aborted while a kernel is pending, within the hard
limit, and a new group that runs a collective afterwards.

One process, a one-rank NCCL group on the rank's device (the last GPU: on a machine of several
GPUs it is not device 0, the device a bare thread is on):

1. the survivor's health check (:class:`elasticft.devicehealth.ArmedDevice`, armed from the
   group's bound device as recovery arms) synchronizes from its helper thread; the thread's
   current device, read there, must be the rank's (a bare thread's is printed beside it);
2. a long kernel (``torch.cuda._sleep``) is queued on the current stream and an
   ``all_reduce`` behind it, so the collective is pending when the monitor's path ends the
   groups (:func:`elasticft.inprocess.groups.end_groups`, NCCL's ``_abort_process_group``);
   the abort must return within the limit; twice;
3. a new group forms and its ``all_reduce`` gives the right sum.

It prints one line per check and exits 1 when one fails:

    python bench/inprocess_abort_gpu.py [--limit-s 30] [--sleep-cycles 2000000000]
    python bench/inprocess_abort_gpu.py --dry-run

Without CUDA (or with ``--dry-run``) it runs the parts that need none, in one line: the
known-answer matmul, the rank's device as recovery arms (none), and the same group sequence on
gloo: a group aborted with torch's real ``_abort_process_group``, then a new group whose
``all_reduce`` is right.
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

from elasticft.devicehealth import ArmedDevice, CudaCalls, known_answer, within
from elasticft.inprocess.groups import end_groups
from elasticft.inprocess.ncclenv import abort_warning, nccl_version


def new_group(backend: str, device: torch.device | None, limit_s: float) -> float:
    """A one-rank group on a store of its own; its all_reduce's seconds (raises if wrong)."""
    store = dist.TCPStore("127.0.0.1", 0, 1, True)
    dist.init_process_group(backend, store=store, rank=0, world_size=1, device_id=device,
                            timeout=timedelta(seconds=max(60, 2 * limit_s)))
    x = torch.full((1 << 20,), 2.0, device=device)
    started = time.perf_counter()
    dist.all_reduce(x)
    if device is not None:
        torch.cuda.synchronize(device)
    seconds = time.perf_counter() - started
    if not bool((x == 2.0).all()):
        raise RuntimeError("the new group's all_reduce gave a wrong sum")
    return seconds


def dry_run(limit_s: float) -> int:
    """The parts without CUDA: the known answer, the rank's device (none), gloo's sequence."""
    computed = known_answer()
    armed = ArmedDevice.arm(None)
    new_group("gloo", None, limit_s)
    started = time.perf_counter()
    dist.distributed_c10d._abort_process_group()
    abort_s = time.perf_counter() - started
    gone = not dist.is_initialized()  # the WORLD abort clears torch's table of groups
    collective_s = new_group("gloo", None, limit_s)
    dist.destroy_process_group()
    ok = computed.ok and armed.device is None and gone
    print(f"inprocess_abort_gpu: dry run (no CUDA device or --dry-run): known answer "
          f"{'right' if computed.ok else 'WRONG'}, rank device {armed.index}, gloo group "
          f"aborted by _abort_process_group in {abort_s:.3f} s "
          f"({'table cleared' if gone else 'TABLE NOT CLEARED'}), a new group's all_reduce "
          f"right in {collective_s:.3f} s; nothing measured on a GPU")
    return 0 if ok else 1


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--limit-s", type=float, default=30.0, help="the teardown's hard limit")
    parser.add_argument("--sleep-cycles", type=int, default=2_000_000_000)
    parser.add_argument("--dry-run", action="store_true")
    args = parser.parse_args()
    if args.dry_run or not torch.cuda.is_available():
        return dry_run(args.limit_s)
    index = torch.cuda.device_count() - 1
    device = torch.device("cuda", index)
    torch.cuda.set_device(device)
    version = nccl_version()
    print(f"nccl {version}: {abort_warning(version) or 'abort not known to be broken'}; "
          f"{torch.cuda.device_count()} GPU(s), the rank's is GPU {index}")
    ok = True
    bare: list[int] = []
    within(lambda: bare.append(torch.cuda.current_device()), args.limit_s)
    for attempt in (1, 2):
        new_group("nccl", device, args.limit_s)
        armed = ArmedDevice.arm(device)  # as recovery arms: the group's bound device
        torch.cuda._sleep(args.sleep_cycles)  # a long kernel, then a collective behind it
        dist.all_reduce(torch.ones(1 << 20, device=device), async_op=True)
        started = time.perf_counter()
        finished, error = within(lambda: end_groups("nccl"), args.limit_s)
        abort_s = time.perf_counter() - started
        print(f"attempt {attempt}: abort with a pending kernel "
              f"{'returned' if finished else 'DID NOT RETURN'} in {abort_s:.3f} s "
              f"(limit {args.limit_s:.0f} s){f', error {error!r}' if error else ''}")
        ok &= finished
        destroyed = True
        if dist.is_initialized():  # the default group's abort cleared torch's table already
            destroyed, _ = within(dist.destroy_process_group, args.limit_s)
        verdict = armed.check(args.limit_s, CudaCalls.of_torch())
        seen = verdict.evidence.get("thread_device")
        print(f"attempt {attempt}: destroy {'done' if destroyed else 'HUNG'}; health check "
              f"{'passed' if verdict.ok else 'FAILED: ' + verdict.detail} in "
              f"{verdict.seconds:.3f} s; its thread synchronized GPU {seen} (the rank's: "
              f"{index}; a bare thread is on GPU {bare[0] if bare else '?'}); NVML "
              f"{verdict.evidence.get('nvml')}")
        ok &= destroyed and verdict.ok and seen == index
    try:
        collective_s = new_group("nccl", device, args.limit_s)
        dist.destroy_process_group()
        print(f"a new group formed after the aborts; its all_reduce was right in "
              f"{collective_s:.3f} s")
    except Exception as e:  # the figure the check is for: say it, then fail
        print(f"a new group after the aborts FAILED: {type(e).__name__}: {e}")
        ok = False
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
