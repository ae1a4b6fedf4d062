"""Named hardware and model descriptions, and loading either from a name or a file.

Hardware numbers are datasheet peaks with achieved fractions typical of large-model training:
A100 SXM bf16 312 TFLOP/s, NVLink all-reduce bus bandwidth about 230 GB/s, DGX A100 networks of
8 x 200 Gb/s HDR InfiniBand (200 GB/s per node). ``cpu`` describes the small gloo runs of the
examples and tests. The models are the GPT configurations of Megatron-LM's scaling study
(Narayanan et al., SC'21, Table 1: vocabulary 51200, sequence 2048) and the OPT/GPT-2 models of
Resilio's HPPS evaluation.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from elasticft.plan.api import Hardware, ModelSpec, PlanError

_A100_80G = Hardware(
    name="a100-80g", memory_gib=80, peak_tflops=312, compute_efficiency=0.55,
    intra_node_gbps=230, inter_node_gbps=200, latency_us=10,
)
HARDWARE: dict[str, Hardware] = {hardware.name: hardware for hardware in (
    _A100_80G,
    dataclasses.replace(_A100_80G, name="a100-40g", memory_gib=40),
    Hardware(
        name="h100-80g", memory_gib=80, peak_tflops=989, compute_efficiency=0.5,
        intra_node_gbps=360, inter_node_gbps=400, latency_us=8,
    ),
    Hardware(
        name="cpu", memory_gib=4, peak_tflops=0.05, compute_efficiency=0.5,
        intra_node_gbps=2, inter_node_gbps=1, latency_us=50,
    ),
)}


def _megatron(name: str, heads: int, hidden: int, layers: int, batch: int) -> ModelSpec:
    return ModelSpec(
        name=name, layers=layers, hidden=hidden, heads=heads, seq_len=2048, vocab=51200,
        global_batch=batch, micro_batch=1, activation_recompute="full",
    )


def _hpps(name: str, heads: int, hidden: int, layers: int, vocab: int = 50272) -> ModelSpec:
    return ModelSpec(
        name=name, layers=layers, hidden=hidden, heads=heads, seq_len=1024, vocab=vocab,
        global_batch=256, micro_batch=4,
    )


MODELS: dict[str, ModelSpec] = {model.name: model for model in (
    _megatron("gpt-1.7b", 24, 2304, 24, 512),
    _megatron("gpt-3.6b", 32, 3072, 30, 512),
    _megatron("gpt-7.5b", 32, 4096, 36, 512),
    _megatron("gpt-18.4b", 48, 6144, 40, 1024),
    _megatron("gpt-39.1b", 64, 8192, 48, 1536),
    _megatron("gpt-76.1b", 80, 10240, 60, 1792),
    _megatron("gpt-145.6b", 96, 12288, 80, 2304),
    _megatron("gpt-310.1b", 128, 16384, 96, 2160),
    _megatron("gpt-529.6b", 128, 20480, 105, 2520),
    _megatron("gpt-1008b", 160, 25600, 128, 3072),
    # Resilio HPPS (Table 10: batch 256); sequence length 1024 as in the GPT-2 benchmarks.
    _hpps("opt-1.3b", 32, 2048, 24),
    _hpps("opt-2.7b", 32, 2560, 32),
    _hpps("opt-6.7b", 32, 4096, 32),
    _hpps("gpt2-1.5b", 25, 1600, 48, vocab=50257),
)}


def load_hardware(spec: str) -> Hardware:
    """A preset name (``a100-80g``...) or a JSON file of Hardware fields."""
    if spec in HARDWARE:
        return HARDWARE[spec]
    path = Path(spec)
    if not path.is_file():
        raise PlanError(
            f"hardware {spec!r} is neither a preset ({', '.join(sorted(HARDWARE))}) nor a file"
        )
    try:
        return Hardware.from_mapping(json.loads(path.read_text()))
    except (OSError, json.JSONDecodeError) as e:
        raise PlanError(f"cannot read hardware description {path}: {e}") from e


def load_model(spec: str | Path) -> ModelSpec:
    """A preset name (``gpt-1.7b``...) or a JSON/YAML model description file."""
    if str(spec) in MODELS:
        return MODELS[str(spec)]
    path = Path(spec)
    if not path.is_file():
        raise PlanError(
            f"model {str(spec)!r} is neither a preset ({', '.join(sorted(MODELS))}) nor a file"
        )
    return ModelSpec.from_file(path)
