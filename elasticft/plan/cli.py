"""``elasticft plan``: ranked layouts for a model on a cluster, with time and memory.

Example::

    elasticft plan --nodes 4 --gpus-per-node 8 --model gpt-7.5b --hardware a100-80g
    elasticft plan --nodes 2 --gpus-per-node 2 --model my_model.json --tp 2 --top 5
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from typing import Any

from elasticft.plan.api import Cluster, Pins, PlanError


def register(subparsers: Any) -> None:
    from elasticft.plan.presets import HARDWARE, MODELS

    p = subparsers.add_parser(
        "plan",
        help="rank 3D-parallel layouts (TP, PP, DP) for a model on a cluster",
        description=__doc__.splitlines()[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=f"model presets: {', '.join(MODELS)}\nhardware presets: {', '.join(HARDWARE)}",
    )
    p.add_argument("--nodes", type=int, required=True, help="number of nodes")
    p.add_argument("--gpus-per-node", type=int, required=True, help="GPUs (workers) per node")
    p.add_argument("--model", required=True,
                   help="a preset name or a JSON/YAML model description file")
    p.add_argument("--hardware", default="a100-80g", help="a preset name or a JSON file")
    p.add_argument("--gpu-memory-gib", type=float, help="override the memory per GPU")
    p.add_argument("--probe", action="store_true",
                   help="measure this machine's compute speed and plan with it")
    p.add_argument("--tp", type=int, help="pin tensor parallelism")
    p.add_argument("--pp", type=int, help="pin pipeline parallelism")
    p.add_argument("--dp", type=int, help="pin data parallelism")
    p.add_argument("--top", type=int, default=10, help="how many layouts to print (default 10)")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    from elasticft.cli import CliError
    from elasticft.plan.presets import load_hardware, load_model
    from elasticft.plan.search import plan

    try:
        model = load_model(args.model)
        hardware = load_hardware(args.hardware)
        if args.gpu_memory_gib is not None:
            hardware = dataclasses.replace(hardware, memory_gib=args.gpu_memory_gib)
        if args.probe:
            from elasticft.plan.probe import probed

            hardware = probed(hardware)
        cluster = Cluster(args.nodes, args.gpus_per_node)
        started = time.perf_counter()
        result = plan(model, hardware, cluster, Pins(args.tp, args.pp, args.dp))
        elapsed = time.perf_counter() - started
    except PlanError as e:
        raise CliError(str(e)) from None
    shown = result.candidates[: max(1, args.top)]
    if args.json:
        print(json.dumps({
            "model": model.name, "hardware": hardware.name, "nodes": cluster.nodes,
            "gpus_per_node": cluster.gpus_per_node, "plan_seconds": elapsed,
            "layouts": [
                {"layout": dataclasses.asdict(c.layout), "estimate": dataclasses.asdict(c.estimate)}
                for c in shown
            ],
        }, indent=2))
        return 0
    print(
        f"{model.name} ({model.total_params:.3g} params, global batch "
        f"{model.global_batch}, micro-batch {model.micro_batch}) on {cluster.nodes} x "
        f"{cluster.gpus_per_node} {hardware.name} ({hardware.memory_gib:g} GiB): "
        f"{result.considered} layouts, {result.pruned_for_memory} do not fit, "
        f"planned in {elapsed * 1000:.1f} ms"
    )
    header = (f"{'#':>3} {'TP':>3} {'PP':>4} {'DP':>5} {'accum':>6} {'GPUs':>5} {'time s':>9} "
              f"{'mem GiB':>8} {'MFU':>5} {'bubble':>7} {'TP comm':>8} {'DP comm':>8}")
    print(header)
    for i, c in enumerate(shown, 1):
        lay, est = c.layout, c.estimate
        print(f"{i:>3} {lay.tp:>3} {lay.pp:>4} {lay.dp:>5} {lay.grad_accum:>6} "
              f"{lay.gpus_used:>5} {est.time_s:>9.4g} {est.memory_gib:>8.3g} {est.mfu:>5.2f} "
              f"{est.bubble_s:>7.3g} {est.tp_comm_s:>8.3g} {est.dp_comm_s:>8.3g}")
    return 0
