"""Diagnostics benchmarks: NCCL shim cost per call, recorder cost per step, hang detection latency.

    .venv/bin/python bench/diag_bench.py [--calls 200000] [--steps 200] [--skip-hang]

1. Shim: a C program calls a fake ncclAllReduce in a loop, without the shim, with the shim
   preloaded but disabled, enabled without a CUDA runtime (host completion), and enabled with a
   fake CUDA runtime (two events per call, polled by the shim's thread). ns per call.
2. Recorder: one gloo process, two identical DDP models stepped alternately in the same run, one
   with the timed bucket hook, wrapped collectives and step hook, one without. Median step time.
3. Hang: elasticft-run, 2 gloo workers, one SIGSTOPped at step 25; seconds from the signal to the
   `detection` event, against gloo's default collective timeout under torchrun (30 minutes).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FAKE = ROOT / "tests" / "diag" / "fake"
GLOO_DEFAULT_TIMEOUT_S = 1800.0

LOOP_C = r"""
#include <stdio.h>
#include <stdlib.h>
#include <time.h>
typedef struct ncclComm *ncclComm_t;
int ncclAllReduce(const void *, void *, size_t, int, int, ncclComm_t, void *);
int main(int argc, char **argv) {
    long n = atol(argv[1]);
    struct timespec a, b;
    clock_gettime(CLOCK_MONOTONIC, &a);
    for (long i = 0; i < n; i++) ncclAllReduce(NULL, NULL, 1024, 7, 0, NULL, NULL);
    clock_gettime(CLOCK_MONOTONIC, &b);
    printf("%.1f\n", ((b.tv_sec - a.tv_sec) * 1e9 + (b.tv_nsec - a.tv_nsec)) / n);
    return 0;
}
"""


def bench_shim(calls: int) -> list[tuple[str, float]]:
    from elasticft.diag.workerenv import shim_library

    shim = shim_library()
    if shim is None or shutil.which("gcc") is None:
        return []
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp)
        (out / "loop.c").write_text(LOOP_C)
        subprocess.run(["gcc", "-O2", "-shared", "-fPIC", "-o", out / "libnccl.so",
                        FAKE / "fake_nccl.c"], check=True)
        subprocess.run(["gcc", "-O2", "-shared", "-fPIC", "-o", out / "libcudart.so",
                        FAKE / "fake_cudart.c"], check=True)
        subprocess.run(["gcc", "-O2", "-o", out / "loop", out / "loop.c", f"-L{out}", "-lnccl",
                        f"-Wl,-rpath,{out}"], check=True)
        base = {"PATH": "/usr/bin:/bin", "RANK": "0", "FAKE_GPU_MS": "0"}
        on = {"ELASTICFT_DIAG_SHIM": "1", "ELASTICFT_DIAG_RING_DIR": tmp}
        cases = [
            ("no shim", {}),
            ("shim preloaded, disabled", {"LD_PRELOAD": str(shim)}),
            ("shim on, no CUDA runtime", {"LD_PRELOAD": str(shim), **on,
                                          "ELASTICFT_DIAG_CUDART": "/nonexistent"}),
            ("shim on, fake CUDA events", {"LD_PRELOAD": str(shim), **on,
                                           "ELASTICFT_DIAG_CUDART": str(out / "libcudart.so")}),
        ]
        results = []
        for name, extra in cases:
            runs = []
            for _ in range(3):
                done = subprocess.run([out / "loop", str(calls)], env={**base, **extra},
                                      capture_output=True, text=True, check=True)
                runs.append(float(done.stdout))
            results.append((name, statistics.median(runs)))
        return results


RECORDER_SCRIPT = textwrap.dedent("""
    import statistics, sys, tempfile, time
    from pathlib import Path
    import torch, torch.distributed as dist
    from elasticft.diag.recorder import Recorder
    torch.set_num_threads(1)
    steps = int(sys.argv[1])
    dist.init_process_group("gloo", init_method="tcp://127.0.0.1:0", rank=0, world_size=1)
    def make():
        torch.manual_seed(0)
        layers = [torch.nn.Linear(512, 512) for _ in range(6)]
        return torch.nn.parallel.DistributedDataParallel(torch.nn.Sequential(*layers),
                                                         bucket_cap_mb=1)
    plain, watched = make(), make()
    recorder = Recorder.open(Path(tempfile.mkdtemp()), 0)
    recorder.attach_ddp(watched)
    recorder.start_heartbeat()
    opts = {m: torch.optim.SGD(m.parameters(), lr=0.01) for m in (plain, watched)}
    x = torch.randn(64, 512)
    times = {plain: [], watched: []}
    for i in range(steps * 2):
        m = plain if i % 2 == 0 else watched
        t = time.perf_counter()
        m(x).pow(2).mean().backward()
        opts[m].step()
        opts[m].zero_grad()
        if m is watched:
            recorder.mark_step()
        times[m].append(time.perf_counter() - t)
    p, w = statistics.median(times[plain][5:]), statistics.median(times[watched][5:])
    print(f"{p * 1e3:.3f} {w * 1e3:.3f}")
""")


def bench_recorder(steps: int) -> tuple[float, float]:
    done = subprocess.run([sys.executable, "-c", RECORDER_SCRIPT, str(steps)], cwd=ROOT,
                          capture_output=True, text=True, check=True, timeout=600)
    plain, watched = map(float, done.stdout.split())
    return plain, watched


def bench_hang() -> float | None:
    from elasticft.chaos import worker_pid
    from elasticft.events import read_events

    with tempfile.TemporaryDirectory() as tmp:
        t = Path(tmp)
        run_dir, marker = t / "run", t / "marker"
        # Tuning constants have no flag: tests/tuned_run.py sets them through the Python API.
        tuning = json.dumps({"hang_heartbeat_stale_s": "2", "hang_collective_floor_s": "2"})
        cmd = [sys.executable, str(ROOT / "tests" / "tuned_run.py"), tuning, "--",
               "--standalone", "--nproc-per-node", "2", "--max-restarts", "1",
               "--monitor-interval", "0.1", "--run-dir", str(run_dir), "--shutdown-timeout", "5",
               str(ROOT / "tests" / "diag" / "workers" / "diag_train.py"), "--steps", "60",
               "--state", str(t / "state"), "--marker-at", "25", "--marker", str(marker)]
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            deadline = time.monotonic() + 120
            while not marker.exists() and time.monotonic() < deadline:
                time.sleep(0.1)
            victim = worker_pid(run_dir, 1)
            stopped = time.time()
            os.kill(victim, signal.SIGSTOP)
            while time.monotonic() < deadline + 60:
                hangs = [e for e in read_events(run_dir)
                         if e["kind"] == "detection" and e["detector"] == "hang"]
                if hangs:
                    os.kill(victim, signal.SIGCONT)
                    return hangs[0]["time"] - stopped
                time.sleep(0.05)
            return None
        finally:
            proc.wait(timeout=180)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=200_000)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--skip-hang", action="store_true")
    args = parser.parse_args()
    print(f"machine: {platform.machine()} {os.cpu_count()} cores, {platform.platform()}, "
          f"Python {platform.python_version()}; date {datetime.date.today()}")
    print("\nNCCL shim, fake ncclAllReduce loop (ns per call, median of 3 runs):")
    shim = bench_shim(args.calls)
    base = shim[0][1] if shim else 0.0
    for name, ns in shim:
        print(f"  {name:<28} {ns:8.1f} ns   (+{ns - base:.1f} ns)")
    plain, watched = bench_recorder(args.steps)
    print(f"\nrecorder, gloo DDP step (6x Linear(512), 6 buckets), median of {args.steps} steps:")
    print(f"  without {plain:.3f} ms   with {watched:.3f} ms   overhead "
          f"{(watched / plain - 1) * 100:+.2f}%")
    if not args.skip_hang:
        latency = bench_hang()
        print("\nhang (worker SIGSTOPped, hang_heartbeat_stale_s=2 "
              "hang_collective_floor_s=2): detected after "
              f"{latency:.2f} s vs gloo default timeout {GLOO_DEFAULT_TIMEOUT_S:.0f} s "
              f"({GLOO_DEFAULT_TIMEOUT_S / latency:.0f}x sooner)" if latency else
              "\nhang: not detected")
    return 0


if __name__ == "__main__":
    sys.exit(main())
