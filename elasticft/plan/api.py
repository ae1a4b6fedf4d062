"""What the layout planner takes and gives: a model, the hardware, a layout and its estimate.

A *layout* is how one training job spreads over GPUs: tensor parallelism (TP, splits each layer's
matrices over GPUs of one node), pipeline parallelism (PP, splits the layers into stages) and data
parallelism (DP, replicas that average their gradients). TP x PP x DP GPUs are used; any others
stay idle. Each replica processes ``global_batch / DP`` samples per iteration as ``grad_accum``
micro-batches, so the global batch — and so the training curve — does not depend on the layout.

Everything here is plain data (frozen dataclasses, JSON round-trips) so a layout can travel
through a rendezvous store and environment variables without pickle.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2, "fp8": 1}
OPTIMIZER_STATE_BYTES = {"adam": 8, "adamw": 8, "sgd_momentum": 4, "sgd": 0}
Recompute = Literal["none", "selective", "full"]


class PlanError(ValueError):
    """The planner's inputs are unusable or nothing fits; ``reason`` is machine-readable."""

    def __init__(self, message: str, reason: str = "bad_plan_input") -> None:
        super().__init__(message)
        self.reason = reason


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    """A decoder-only transformer as the cost model sees it."""

    layers: int
    hidden: int
    heads: int
    seq_len: int
    global_batch: int
    """Samples (sequences) per iteration, over all replicas and micro-batches."""
    micro_batch: int = 1
    """Samples per forward/backward pass on one replica."""
    params: int = 0
    """Total parameters; 0 derives it from layers, hidden and vocab."""
    vocab: int = 0
    """Vocabulary size; 0 derives the embedding size from ``params``."""
    ffn_hidden: int = 0
    """MLP inner size; 0 means 4 x hidden."""
    name: str = "model"
    param_dtype: str = "bf16"
    grad_dtype: str = "fp32"
    """Megatron and most mixed-precision trainers accumulate gradients in fp32."""
    activation_dtype: str = "bf16"
    optimizer: str = "adam"
    distributed_optimizer: bool = False
    """Optimizer state sharded over the data-parallel group (ZeRO-1)."""
    activation_recompute: Recompute = "none"

    def __post_init__(self) -> None:
        for name in ("layers", "hidden", "heads", "seq_len", "global_batch", "micro_batch"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise PlanError(f"model {name}={value!r} must be a positive integer")
        if self.global_batch % self.micro_batch:
            raise PlanError(
                f"model global_batch={self.global_batch} is not a multiple of "
                f"micro_batch={self.micro_batch}; pick sizes where it is"
            )
        for name in ("param_dtype", "grad_dtype", "activation_dtype"):
            if getattr(self, name) not in DTYPE_BYTES:
                raise PlanError(
                    f"model {name}={getattr(self, name)!r} is unknown; use one of "
                    f"{sorted(DTYPE_BYTES)}"
                )
        if self.optimizer not in OPTIMIZER_STATE_BYTES:
            raise PlanError(
                f"model optimizer={self.optimizer!r} is unknown; use one of "
                f"{sorted(OPTIMIZER_STATE_BYTES)}"
            )
        if self.activation_recompute not in ("none", "selective", "full"):
            raise PlanError(
                f"model activation_recompute={self.activation_recompute!r} is unknown; use "
                "none, selective or full"
            )
        if self.params and self.params < self.layers * self.layer_params:
            raise PlanError(
                f"model params={self.params} is less than its {self.layers} layers alone "
                f"({self.layers * self.layer_params}); check hidden and layers"
            )

    @property
    def ffn(self) -> int:
        return self.ffn_hidden or 4 * self.hidden

    @property
    def layer_params(self) -> int:
        """Attention (4 h^2) + MLP (2 h ffn) weights, their biases and two layer norms."""
        h = self.hidden
        return 4 * h * h + 2 * h * self.ffn + 9 * h + self.ffn

    @property
    def embedding_params(self) -> int:
        if self.params:
            return self.params - self.layers * self.layer_params
        return self.vocab * self.hidden + self.seq_len * self.hidden

    @property
    def total_params(self) -> int:
        return self.layers * self.layer_params + self.embedding_params

    @property
    def vocab_size(self) -> int:
        """The vocabulary (for the logits' cost); derived from the embedding when not given."""
        return self.vocab or max(0, self.embedding_params - self.seq_len * self.hidden) // max(
            1, self.hidden
        )

    def flops_per_iteration(self) -> float:
        """Model FLOPs of one iteration (forward + backward, no recompute): MFU's numerator."""
        b, s, h = self.global_batch, self.seq_len, self.hidden
        layer = 8 * b * s * h * h + 4 * b * s * h * self.ffn + 4 * b * s * s * h
        return 3.0 * (self.layers * layer + 2 * b * s * h * self.vocab_size)

    @classmethod
    def from_mapping(cls, data: Mapping[str, Any]) -> ModelSpec:
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise PlanError(
                f"model description has unknown key(s) {unknown}; known keys: {sorted(known)}"
            )
        return cls(**dict(data))

    @classmethod
    def from_file(cls, path: Path) -> ModelSpec:
        """Reads a JSON or YAML model description."""
        try:
            text = Path(path).read_text()
        except OSError as e:
            raise PlanError(f"cannot read model description {path}: {e.strerror}") from e
        if Path(path).suffix in (".yaml", ".yml"):
            import yaml

            data = yaml.safe_load(text)
        else:
            data = json.loads(text)
        if not isinstance(data, dict):
            raise PlanError(f"model description {path} must hold a mapping of keys to values")
        return cls.from_mapping(data)


@dataclasses.dataclass(frozen=True)
class Hardware:
    """Speeds and sizes of one GPU and its links (given, from a preset, or probed)."""

    name: str = "custom"
    memory_gib: float = 80.0
    usable_memory_fraction: float = 0.92
    """The rest goes to the framework, allocator fragmentation and communication buffers."""
    peak_tflops: float = 312.0
    compute_efficiency: float = 0.55
    """Fraction of peak that large matrix products reach."""
    intra_node_gbps: float = 200.0
    """Achieved all-reduce bus bandwidth between GPUs of one node, GB/s per GPU."""
    inter_node_gbps: float = 100.0
    """Network bandwidth of one node, GB/s, shared by the node's GPUs."""
    latency_us: float = 10.0
    """Per-hop latency of a collective or point-to-point message."""

    def __post_init__(self) -> None:
        for name in ("memory_gib", "peak_tflops", "intra_node_gbps", "inter_node_gbps"):
            if getattr(self, name) <= 0:
                raise PlanError(f"hardware {name}={getattr(self, name)} must be positive")
        if not 0 < self.compute_efficiency <= 1:
            raise PlanError(
                f"hardware compute_efficiency={self.compute_efficiency} must be in (0, 1]"
            )
        if not 0 < self.usable_memory_fraction <= 1:
            raise PlanError(
                f"hardware usable_memory_fraction={self.usable_memory_fraction} must be in (0, 1]"
            )

    @property
    def flops(self) -> float:
        """Achieved FLOP/s of one GPU."""
        return self.peak_tflops * 1e12 * self.compute_efficiency

    @classmethod
    def from_mapping(cls, data: Mapping[str, Any]) -> Hardware:
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise PlanError(f"hardware has unknown key(s) {unknown}; known keys: {sorted(known)}")
        return cls(**dict(data))


@dataclasses.dataclass(frozen=True)
class Cluster:
    nodes: int
    gpus_per_node: int

    def __post_init__(self) -> None:
        if self.nodes < 1 or self.gpus_per_node < 1:
            raise PlanError(
                f"cluster of {self.nodes} node(s) x {self.gpus_per_node} GPU(s) is empty; "
                "give at least one of each"
            )

    @property
    def gpus(self) -> int:
        return self.nodes * self.gpus_per_node


@dataclasses.dataclass(frozen=True)
class Pins:
    """Dimensions the user fixed; None leaves a dimension to the planner."""

    tp: int | None = None
    pp: int | None = None
    dp: int | None = None


NO_PINS = Pins()


@dataclasses.dataclass(frozen=True, order=True)
class Layout:
    """TP x PP x DP, with gradient accumulation keeping the global batch.

    Ranks are ordered TP fastest, then DP, then PP (Megatron's order), so a TP group is a run
    of consecutive ranks inside one node; ranks from ``gpus_used`` on are idle.
    """

    tp: int
    pp: int
    dp: int
    grad_accum: int = 1
    micro_batch: int = 1

    @property
    def gpus_used(self) -> int:
        return self.tp * self.pp * self.dp

    @property
    def mesh_shape(self) -> tuple[int, int, int]:
        """(pp, dp, tp), for ``init_device_mesh(..., mesh_dim_names=("pp", "dp", "tp"))``."""
        return (self.pp, self.dp, self.tp)

    def coords(self, rank: int) -> tuple[int, int, int] | None:
        """(pp index, dp index, tp index) of a rank, or None for an idle rank."""
        if not 0 <= rank < self.gpus_used:
            return None
        return (rank // (self.tp * self.dp), (rank // self.tp) % self.dp, rank % self.tp)

    def describe(self) -> str:
        return f"TP{self.tp}xPP{self.pp}xDP{self.dp} (grad accum {self.grad_accum})"

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), sort_keys=True)


@dataclasses.dataclass(frozen=True)
class Estimate:
    """The cost model's prediction for one layout (per iteration, per GPU)."""

    time_s: float
    memory_gib: float
    """Peak memory of the fullest GPU (first or last pipeline stage)."""
    compute_s: float
    """Pure compute on the critical path (all micro-batches, slowest stage)."""
    bubble_s: float
    """Pipeline fill and drain: (PP-1) stage times plus stage-to-stage transfers."""
    tp_comm_s: float
    pp_comm_s: float
    dp_comm_s: float
    mfu: float
    """Model FLOPs utilisation over the GPUs used."""


@dataclasses.dataclass(frozen=True)
class Candidate:
    layout: Layout
    estimate: Estimate


@dataclasses.dataclass(frozen=True)
class Plan:
    """Feasible layouts, fastest first, and how many were pruned for memory."""

    candidates: tuple[Candidate, ...]
    considered: int
    pruned_for_memory: int

    @property
    def best(self) -> Candidate:
        return self.candidates[0]
