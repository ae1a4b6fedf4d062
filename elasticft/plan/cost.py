"""The cost model: memory and iteration time of one layout, from first principles.

Iteration time follows Resilio's pipeline model (HPPS, eq. 3) for ``B`` micro-batches through
``PP`` stages, where ``p_i`` is stage i's forward+backward time for one micro-batch (its compute
plus its tensor-parallel all-reduces) and ``c_{i,i+1}`` the activation/gradient transfer between
neighbouring stages::

    t_pipeline = sum_i p_i + sum_i c_{i,i+1} + (B - 1) * max_i p_i

to which the data-parallel gradient all-reduce is added (no overlap with backward assumed).

Compute counts matrix FLOPs of a transformer layer (QKV/out projections 8bsh^2, MLP 4bsh*ffn,
attention scores 4bs^2h forward; backward twice that; recomputation adds a forward). The last
stage also computes the logits. Collectives are ring all-reduces: ``2(n-1)/n * bytes / bw``
plus a latency per hop. A TP group lives inside a node (NVLink bandwidth). A DP group or a stage
boundary that leaves the node shares the node's network with the other groups leaving it.

Memory per GPU (the fullest stage): weights, gradients and optimizer state of its share of the
parameters, plus activations of the micro-batches in flight under 1F1B (``min(PP, B)`` on the
first stage), per layer ``sbh(10 + 24/t + 5as/(ht))`` bytes for 16-bit activations
(Korthikanti et al., 2022), less with recomputation.
"""

from __future__ import annotations

from elasticft.plan.api import (
    DTYPE_BYTES,
    OPTIMIZER_STATE_BYTES,
    Cluster,
    Estimate,
    Hardware,
    Layout,
    ModelSpec,
)

_GIB = float(1 << 30)


def layout_problem(model: ModelSpec, cluster: Cluster, layout: Layout) -> str | None:
    """Why a layout cannot run on this cluster at all (memory aside), or None if it can."""
    if min(layout.tp, layout.pp, layout.dp, layout.grad_accum, layout.micro_batch) < 1:
        return "every dimension must be at least 1"
    if cluster.gpus_per_node % layout.tp:
        return f"TP {layout.tp} does not divide the {cluster.gpus_per_node} GPUs of a node"
    if model.heads % layout.tp:
        return f"TP {layout.tp} does not divide the {model.heads} attention heads"
    if model.layers % layout.pp:
        return f"PP {layout.pp} does not divide the {model.layers} layers"
    if layout.gpus_used > cluster.gpus:
        return f"{layout.gpus_used} GPUs needed, {cluster.gpus} present"
    if layout.dp * layout.grad_accum * layout.micro_batch != model.global_batch:
        return (
            f"DP {layout.dp} x grad accum {layout.grad_accum} x micro-batch "
            f"{layout.micro_batch} != global batch {model.global_batch}"
        )
    return None


def _ring_allreduce_s(nbytes: float, members: int, gbps: float, latency_s: float) -> float:
    if members <= 1:
        return 0.0
    return 2 * (members - 1) / members * nbytes / (gbps * 1e9) + 2 * (members - 1) * latency_s


def memory_bytes(model: ModelSpec, layout: Layout) -> float:
    """Peak bytes on the fullest GPU."""
    t, pp, b = layout.tp, layout.pp, layout.micro_batch
    s, h, a = model.seq_len, model.hidden, model.heads
    layers = model.layers // pp
    param_bytes = DTYPE_BYTES[model.param_dtype]
    master = 4 if param_bytes < 4 else 0
    optimizer = (master + OPTIMIZER_STATE_BYTES[model.optimizer]) / (
        layout.dp if model.distributed_optimizer else 1
    )
    per_param = param_bytes + DTYPE_BYTES[model.grad_dtype] + optimizer
    # With one stage, it holds the whole embedding (tied input/output); otherwise the first and
    # the last stage each hold a copy.
    stage_params = (layers * model.layer_params + model.embedding_params) / t

    act_scale = DTYPE_BYTES[model.activation_dtype] / 2
    full_layer = s * b * h * (10 + 24 / t + 5 * a * s / (h * t)) * act_scale
    in_flight = min(pp, layout.grad_accum)
    if model.activation_recompute == "full":
        stored = layers * 2 * s * b * h * act_scale * in_flight + full_layer
    elif model.activation_recompute == "selective":
        stored = layers * s * b * h * (10 + 24 / t) * act_scale * in_flight
    else:
        stored = layers * full_layer * in_flight
    # The last stage materialises fp32 logits and their gradient for its micro-batch.
    logits = 2 * 4 * s * b * model.vocab_size / t
    first = stage_params * per_param + stored
    last = stage_params * per_param + layers * (
        2 * s * b * h * act_scale if model.activation_recompute == "full" else full_layer
    ) + logits
    return max(first, last) if pp > 1 else stored + stage_params * per_param + logits


def estimate(model: ModelSpec, hardware: Hardware, cluster: Cluster, layout: Layout) -> Estimate:
    """Predicted iteration time and memory of a layout (assumed valid: see layout_problem)."""
    t, pp, dp, b = layout.tp, layout.pp, layout.dp, layout.micro_batch
    s, h = model.seq_len, model.hidden
    g = cluster.gpus_per_node
    latency = hardware.latency_us * 1e-6
    layers = model.layers // pp
    recompute = model.activation_recompute

    # Compute of one micro-batch through one stage.
    matmul = 8 * b * s * h * h + 4 * b * s * h * model.ffn
    scores = 4 * b * s * s * h
    forward = matmul + scores
    if recompute == "full":
        layer_flops = 4 * forward
    elif recompute == "selective":
        layer_flops = 3 * forward + scores
    else:
        layer_flops = 3 * forward
    stage_compute = layers * layer_flops / t / hardware.flops
    logits_compute = 6 * b * s * h * model.vocab_size / t / hardware.flops

    # Tensor parallelism: two all-reduces of the layer's activations forward, two backward,
    # two more when the forward is recomputed.
    act_bytes = b * s * h * DTYPE_BYTES[model.activation_dtype]
    allreduces = 6 if recompute == "full" else 4
    tp_per_stage = layers * allreduces * _ring_allreduce_s(
        act_bytes, t, hardware.intra_node_gbps, latency
    )

    p_stage = stage_compute + tp_per_stage
    p_last = p_stage + logits_compute
    stage_times = [p_stage] * (pp - 1) + [p_last]
    micro_batches = layout.grad_accum

    # Stage boundaries: activations forward, their gradient backward; Megatron's scatter/gather
    # sends 1/t of them per GPU. Consecutive stages are t*dp ranks apart.
    crosses_node = t * dp >= g
    link_gbps = hardware.inter_node_gbps / g if crosses_node else hardware.intra_node_gbps
    c_boundary = 2 * (act_bytes / t / (link_gbps * 1e9) + latency)
    pp_comm = (pp - 1) * c_boundary

    pipeline = sum(stage_times) + pp_comm + (micro_batches - 1) * max(stage_times)

    # Data parallelism: all-reduce of this GPU's gradients over its DP group (members t ranks
    # apart). A group inside one node uses NVLink; a group spread over nodes shares the node's
    # network with the node's other groups (t of them leave the node).
    grad_bytes = (layers * model.layer_params + model.embedding_params) / t * DTYPE_BYTES[
        model.grad_dtype
    ]
    if t * dp <= g:
        dp_gbps = hardware.intra_node_gbps
    else:
        dp_gbps = min(hardware.intra_node_gbps, hardware.inter_node_gbps / t)
    dp_comm = _ring_allreduce_s(grad_bytes, dp, dp_gbps, latency)

    time_s = pipeline + dp_comm
    compute = micro_batches * (stage_compute + logits_compute)
    bubble = (pp - 1) * p_stage + pp_comm
    mfu = model.flops_per_iteration() / (time_s * layout.gpus_used * hardware.peak_tflops * 1e12)
    return Estimate(
        time_s=time_s,
        memory_gib=memory_bytes(model, layout) / _GIB,
        compute_s=compute,
        bubble_s=bubble,
        tp_comm_s=micro_batches * tp_per_stage,
        pp_comm_s=pp_comm,
        dp_comm_s=dp_comm,
        mfu=mfu,
    )


def fits(model: ModelSpec, hardware: Hardware, layout: Layout) -> bool:
    usable = hardware.memory_gib * hardware.usable_memory_fraction * _GIB
    return memory_bytes(model, layout) <= usable
