"""The layout search: every valid (TP, PP, DP), pruned for memory, ranked by estimated time.

Only shapes that can run are enumerated, so the search stays small even for thousands of GPUs:
TP divides both the GPUs of a node (TP stays on NVLink) and the attention heads; PP divides the
layers; DP divides ``global_batch / micro_batch`` (the rest is gradient accumulation, which keeps
the global batch) and ``TP x PP x DP`` may be less than the GPUs present — GPUs are left idle
when no layout that uses them all is faster. That is a few thousand cost evaluations at most,
each a handful of arithmetic operations: a 1024-GPU plan takes milliseconds.

The function is pure: same inputs, same ranked output (ties go to fewer GPUs, then smaller PP,
then smaller TP), so every agent that computes it agrees.
"""

from __future__ import annotations

from elasticft.plan.api import (
    NO_PINS,
    Candidate,
    Cluster,
    Hardware,
    Layout,
    ModelSpec,
    Pins,
    Plan,
    PlanError,
)
from elasticft.plan.cost import estimate, fits, layout_problem


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def candidate_layouts(model: ModelSpec, cluster: Cluster, pins: Pins = NO_PINS) -> list[Layout]:
    """Every layout that can run on the cluster, memory aside, honouring the pins."""
    samples = model.global_batch // model.micro_batch
    tps = [t for t in _divisors(cluster.gpus_per_node) if model.heads % t == 0]
    pps = _divisors(model.layers)
    dps = _divisors(samples)
    layouts = []
    for tp in tps if pins.tp is None else [pins.tp]:
        for pp in pps if pins.pp is None else [pins.pp]:
            for dp in dps if pins.dp is None else [pins.dp]:
                if tp * pp * dp > cluster.gpus or samples % dp:
                    continue
                layout = Layout(tp, pp, dp, samples // dp, model.micro_batch)
                if layout_problem(model, cluster, layout) is None:
                    layouts.append(layout)
    return layouts


def plan(
    model: ModelSpec,
    hardware: Hardware,
    cluster: Cluster,
    pins: Pins = NO_PINS,
    *,
    top: int | None = None,
) -> Plan:
    """Ranks the layouts that fit; raises PlanError naming the cause when none does."""
    _check_pins(model, cluster, pins)
    layouts = candidate_layouts(model, cluster, pins)
    if not layouts:
        raise PlanError(
            f"no layout of {model.name} runs on {cluster.nodes} node(s) x "
            f"{cluster.gpus_per_node} GPU(s) with pins {_pins_text(pins)}; "
            "loosen the pins or change the batch sizes",
            reason="no_valid_layout",
        )
    fitting = [layout for layout in layouts if fits(model, hardware, layout)]
    if not fitting:
        raise PlanError(
            f"{model.name} fits in no layout on {cluster.gpus} GPU(s) of "
            f"{hardware.memory_gib:g} GiB with pins {_pins_text(pins)}; add GPUs, enable "
            "activation_recompute or distributed_optimizer, or lower micro_batch",
            reason="does_not_fit",
        )
    ranked = sorted(
        (Candidate(layout, estimate(model, hardware, cluster, layout)) for layout in fitting),
        key=lambda c: (c.estimate.time_s, c.layout.gpus_used, c.layout.pp, c.layout.tp),
    )
    return Plan(
        candidates=tuple(ranked[:top] if top else ranked),
        considered=len(layouts),
        pruned_for_memory=len(layouts) - len(fitting),
    )


def _pins_text(pins: Pins) -> str:
    fixed = [f"{k}={v}" for k, v in (("tp", pins.tp), ("pp", pins.pp), ("dp", pins.dp)) if v]
    return ",".join(fixed) or "none"


def _check_pins(model: ModelSpec, cluster: Cluster, pins: Pins) -> None:
    for name, value in (("tp", pins.tp), ("pp", pins.pp), ("dp", pins.dp)):
        if value is not None and value < 1:
            raise PlanError(f"pinned {name}={value} must be at least 1, or left unpinned")
    if pins.tp is not None and cluster.gpus_per_node % pins.tp:
        raise PlanError(
            f"pinned tp={pins.tp} does not divide the {cluster.gpus_per_node} GPUs per node; "
            "tensor parallelism stays inside a node"
        )
    if pins.pp is not None and model.layers % pins.pp:
        raise PlanError(f"pinned pp={pins.pp} does not divide the model's {model.layers} layers")
    if pins.dp is not None and (model.global_batch // model.micro_batch) % pins.dp:
        raise PlanError(
            f"pinned dp={pins.dp} does not divide global_batch/micro_batch = "
            f"{model.global_batch // model.micro_batch}"
        )
