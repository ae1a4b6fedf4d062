"""NCCL shim cost per call on the host, against the real libnccl without it, in the same run.

    .venv/bin/python bench/shim_overhead.py [--calls 200000] [--rounds 5]

The real libnccl.so.2 (PyPI's nvidia-nccl-cu13, the ``dev`` extra) is the DT_NEEDED of a small
library built here and loaded with ``ctypes.CDLL(..., RTLD_LOCAL)``, as torch loads
libtorch_cuda.so. Each measurement runs in its own process, alternating between settings
round after round; each call is timed on its own (CLOCK_MONOTONIC around it, the same in every
setting) and the median over all calls of a round is kept, then the lowest over rounds (other
load on the host only ever adds time).

1. ``ncclGroupStart`` + ``ncclGroupEnd`` pairs (what NCCL does on the host without a GPU): no
   shim, shim preloaded but disabled, shim recording.
2. ``ncclAllReduce`` on a null communicator: NCCL's argument check answers, the shim records
   the call and its error (publish, host completion).
3. The timed path: a collective of a fake NCCL that returns at once, with a fake CUDA runtime
   whose events cost nothing (tests/diag/fake): what the shim itself adds around the two
   cudaEventRecord calls of a GPU run (those two are measured by bench/gpu_check.sh on a GPU).

Prints ns per call and the shim's added ns and ratio per setting.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FAKE = ROOT / "tests" / "diag" / "fake"

LOOPS_C = r"""
#include <stdlib.h>
#include <time.h>
typedef struct ncclComm *ncclComm_t;
int ncclGroupStart(void);
int ncclGroupEnd(void);
int ncclAllReduce(const void *, void *, size_t, int, int, ncclComm_t, void *);
static char buf[64];
static long ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec * 1000000000L + t.tv_nsec;
}
static int cmp(const void *a, const void *b) {
    long x = *(const long *)a, y = *(const long *)b;
    return (x > y) - (x < y);
}
/* Median ns of one call (kind 0: a group pair, 1: an all-reduce) over n calls. */
double median_ns(int kind, long n) {
    long *d = malloc(n * sizeof *d);
    for (long i = 0; i < 1000; i++) {  /* warm up: NCCL's first call initialises it */
        if (kind == 0) { ncclGroupStart(); ncclGroupEnd(); }
        else ncclAllReduce(buf, buf, 4, 7, 0, NULL, NULL);
    }
    for (long i = 0; i < n; i++) {
        long a = ns();
        if (kind == 0) { ncclGroupStart(); ncclGroupEnd(); }
        else ncclAllReduce(buf, buf, 4, 7, 0, NULL, NULL);
        d[i] = ns() - a;
    }
    qsort(d, n, sizeof *d, cmp);
    double m = d[n / 2];
    free(d);
    return m;
}
"""

MEASURE_PY = """
import ctypes, sys
lib = ctypes.CDLL(sys.argv[1], mode=ctypes.RTLD_LOCAL)
lib.median_ns.restype = ctypes.c_double
lib.median_ns.argtypes = [ctypes.c_int, ctypes.c_long]
print(lib.median_ns(int(sys.argv[2]), int(sys.argv[3])))
"""


def nccl_dir() -> Path:
    if os.environ.get("ELASTICFT_TEST_NCCL_DIR"):
        return Path(os.environ["ELASTICFT_TEST_NCCL_DIR"])
    try:
        import nvidia.nccl  # type: ignore[import-not-found]
    except ImportError:
        sys.exit("bench/shim_overhead.py: the real libnccl is missing; "
                 "install the dev extra: pip install -e '.[dev]'")
    return Path(next(iter(nvidia.nccl.__path__))) / "lib"


def build(out: Path) -> dict[str, Path]:
    from elasticft.diag.workerenv import shim_library

    shim = shim_library()
    if shim is None:
        sys.exit("bench/shim_overhead.py: the shim is not built; run "
                 "python setup.py build_ext --inplace")
    (out / "loops.c").write_text(LOOPS_C)
    real = nccl_dir()
    fake = out / "fake"
    fake.mkdir()
    cc = ["cc", "-O2", "-shared", "-fPIC"]
    subprocess.run([*cc, "-o", str(out / "libreal.so"), str(out / "loops.c"), f"-L{real}",
                    "-l:libnccl.so.2", f"-Wl,-rpath,{real}"], check=True)
    subprocess.run([*cc, "-o", str(fake / "libnccl.so"), str(FAKE / "fake_nccl.c")], check=True)
    subprocess.run([*cc, "-o", str(out / "libcudart.so"), str(FAKE / "fake_cudart.c")], check=True)
    subprocess.run([*cc, "-o", str(out / "libfake.so"), str(out / "loops.c"), f"-L{fake}",
                    "-lnccl", f"-Wl,-rpath,{fake}"], check=True)
    return {"shim": shim, "real": out / "libreal.so", "fake": out / "libfake.so",
            "cudart": out / "libcudart.so"}


def measure(library: Path, kind: int, calls: int, env: dict[str, str]) -> float:
    done = subprocess.run([sys.executable, "-c", MEASURE_PY, str(library), str(kind), str(calls)],
                          env={"PATH": os.environ.get("PATH", ""), **env}, capture_output=True,
                          text=True, timeout=600, check=True)
    return float(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=200_000, help="calls per measurement")
    parser.add_argument("--rounds", type=int, default=7, help="alternating rounds")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp)
        libs = build(out)
        rings = out / "rings"
        rings.mkdir()
        shim = str(libs["shim"])
        on = {"LD_PRELOAD": shim, "ELASTICFT_DIAG_SHIM": "1",
              "ELASTICFT_DIAG_RING_DIR": str(rings), "RANK": "0"}
        # (section, setting, library, kind, env); the first setting of a section is its baseline.
        settings = [
            ("group pair, real libnccl", "no shim", libs["real"], 0, {}),
            ("group pair, real libnccl", "shim preloaded, disabled", libs["real"], 0,
             {"LD_PRELOAD": shim, "ELASTICFT_DIAG_SHIM": "0"}),
            ("group pair, real libnccl", "shim recording", libs["real"], 0, on),
            ("all_reduce, real libnccl (argument error)", "no shim", libs["real"], 1, {}),
            ("all_reduce, real libnccl (argument error)", "shim recording", libs["real"], 1, on),
            ("all_reduce, fake NCCL + fake CUDA events", "no shim", libs["fake"], 1, {}),
            ("all_reduce, fake NCCL + fake CUDA events", "shim, timed (event pool)", libs["fake"],
             1, {**on, "ELASTICFT_DIAG_CUDART": str(libs["cudart"]), "FAKE_GPU_MS": "0"}),
        ]
        samples: dict[int, list[float]] = {i: [] for i in range(len(settings))}
        for _ in range(args.rounds):
            for i, (_, _, library, kind, env) in enumerate(settings):
                samples[i].append(measure(library, kind, args.calls, env))
    # Other load only ever adds time: the quietest round's median is the cost itself.
    medians = [min(samples[i]) for i in range(len(settings))]
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    print(f"NCCL shim overhead on the host, {stamp}, {platform.node()}, {os.cpu_count()} CPUs "
          f"(load {load}), {args.calls} calls x {args.rounds} rounds (median ns per call, clock "
          f"reads included, lowest round)")
    print("A busy host (load above the CPU count) makes differences of tens of ns noise.")
    rows = []
    baseline = 0.0
    for i, (section, name, *_rest) in enumerate(settings):
        if i == 0 or settings[i - 1][0] != section:
            baseline = medians[i]
            print(f"\n{section}")
        added = medians[i] - baseline
        ratio = medians[i] / baseline if baseline else float("nan")
        extra = "" if name == "no shim" else f"  {added:+7.1f} ns  x{ratio:.2f}"
        print(f"  {name:<28} {medians[i]:8.1f} ns{extra}")
        rows.append({"section": section, "setting": name, "median_ns": medians[i],
                     "added_ns": added, "ratio": ratio, "rounds": samples[i]})
    if os.environ.get("ELASTICFT_BENCH_JSON"):
        Path(os.environ["ELASTICFT_BENCH_JSON"]).write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
