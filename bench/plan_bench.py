"""Layout planner benchmark: plan time at 1024 GPUs and agreement with published layouts.

Prints Markdown: the machine and date, the time to plan 1024 GPUs (128 nodes x 8) for several
models (median of repeated runs), then two comparison tables:

* Megatron-LM's GPT scaling runs on 80 GB A100s (Narayanan et al., SC'21, Table 1): the layout
  the planner chooses for the same GPU count vs the published (TP, PP); our estimate of the
  published layout relative to our choice; and our estimate of the published layout relative
  to the iteration time implied by the published throughput (TFLOP/s per GPU, counted as the
  paper does: 96 B s l h^2 (1 + s/6h + V/16lh) FLOPs per iteration).
* Resilio's HPPS models on one node of 4 A100s (Tables 10-12: batch 256, PP in {2, 4}): our
  chosen layout, estimated iteration time against Table 11's HPPS time, and estimated MFU
  against Table 12's HPPS MFU. The paper does not list TP/DP, only the PP degrees searched.

    .venv/bin/python bench/plan_bench.py
"""

from __future__ import annotations

import datetime
import os
import platform
import statistics
import time

from elasticft.plan.api import Cluster, Pins
from elasticft.plan.presets import HARDWARE, MODELS
from elasticft.plan.search import plan

# name: (TP, PP, GPUs, published TFLOP/s per GPU)
MEGATRON = {
    "gpt-1.7b": (1, 1, 32, 137), "gpt-3.6b": (2, 1, 64, 138), "gpt-7.5b": (4, 1, 128, 142),
    "gpt-18.4b": (8, 1, 256, 135), "gpt-39.1b": (8, 2, 512, 138),
    "gpt-76.1b": (8, 4, 1024, 140), "gpt-145.6b": (8, 8, 1536, 148),
    "gpt-310.1b": (8, 16, 1920, 155), "gpt-529.6b": (8, 35, 2520, 163),
    "gpt-1008b": (8, 64, 3072, 163),
}
# name: (Table 11 HPPS iteration s, Table 12 HPPS MFU %)
RESILIO = {"opt-1.3b": (5.23, 35.93), "opt-2.7b": (8.17, 50.72), "opt-6.7b": (16.61, 64.64),
           "gpt2-1.5b": (8.26, 31.40)}


def _machine() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if "model name" in line)
    except (OSError, StopIteration):
        pass
    return f"{cpu}, {os.cpu_count()} cores, Python {platform.python_version()}"


def plan_time_1024() -> None:
    print("## Plan time for 1024 GPUs (128 nodes x 8 A100-80G)\n")
    print("| model | layouts considered | pruned (memory) | chosen | median plan time |")
    print("|---|---|---|---|---|")
    hw = HARDWARE["a100-80g"]
    for name in ("gpt-7.5b", "gpt-39.1b", "gpt-145.6b", "gpt-1008b"):
        model, cluster = MODELS[name], Cluster(128, 8)
        runs = []
        for _ in range(7):
            started = time.perf_counter()
            result = plan(model, hw, cluster)
            runs.append(time.perf_counter() - started)
        print(f"| {name} | {result.considered} | {result.pruned_for_memory} | "
              f"{result.best.layout.describe()} | {statistics.median(runs) * 1000:.1f} ms |")
    print()


def megatron_table() -> None:
    print("## Against Megatron-LM's published GPT layouts (A100-80G, 8 per node)\n")
    print("| model | GPUs | published TPxPP | chosen | rank of published | "
          "est. published / est. chosen | est. published / measured |")
    print("|---|---|---|---|---|---|---|")
    hw = HARDWARE["a100-80g"]
    for name, (tp, pp, gpus, tflops) in MEGATRON.items():
        model = MODELS[name]
        result = plan(model, hw, Cluster(gpus // 8, 8))
        ranked = list(result.candidates)
        published = next(i for i, c in enumerate(ranked)
                         if (c.layout.tp, c.layout.pp, c.layout.gpus_used) == (tp, pp, gpus))
        pub_est = ranked[published].estimate.time_s
        b, s, h, lay, v = (model.global_batch, model.seq_len, model.hidden, model.layers,
                           model.vocab)
        flops = 96 * b * s * lay * h * h * (1 + s / (6 * h) + v / (16 * lay * h))
        measured = flops / (gpus * tflops * 1e12)
        chosen = ranked[0].layout
        print(f"| {name} | {gpus} | TP{tp}xPP{pp} | TP{chosen.tp}xPP{chosen.pp}xDP{chosen.dp} | "
              f"{published + 1} of {len(ranked)} | {pub_est / ranked[0].estimate.time_s:.3f} | "
              f"{pub_est / measured:.2f} ({pub_est:.1f} s vs {measured:.1f} s) |")
    print()


def resilio_table() -> None:
    print("## Against Resilio HPPS (Tables 10-12: 1 node x 4 A100, batch 256)\n")
    print("| model | chosen | best with PP 2 / PP 4 | est. time / Table 11 HPPS time | "
          "est. MFU vs Table 12 HPPS MFU |")
    print("|---|---|---|---|---|")
    hw = HARDWARE["a100-80g"]
    for name, (hpps_s, hpps_mfu) in RESILIO.items():
        model, cluster = MODELS[name], Cluster(1, 4)
        best = plan(model, hw, cluster).best
        with_pp = []
        for pp in (2, 4):
            try:
                c = plan(model, hw, cluster, Pins(pp=pp)).best
                with_pp.append(f"{c.layout.describe().split(' ')[0]} {c.estimate.time_s:.2f} s")
            except ValueError:
                with_pp.append(f"PP{pp}: none")
        print(f"| {name} | {best.layout.describe()} | {' / '.join(with_pp)} | "
              f"{best.estimate.time_s:.2f} s / {hpps_s} s = {best.estimate.time_s / hpps_s:.2f} | "
              f"{best.estimate.mfu * 100:.1f} % vs {hpps_mfu} % |")
    print()


def main() -> None:
    now = datetime.datetime.now().astimezone().strftime("%Y-%m-%d %H:%M %Z")
    print(f"Machine: {_machine()}; date: {now}\n")
    plan_time_1024()
    megatron_table()
    resilio_table()


if __name__ == "__main__":
    main()
