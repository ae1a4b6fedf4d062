"""Small shared pieces of the checkpoint tests: a model with optimizer state, unique shm names."""

from __future__ import annotations

import os
import uuid

import torch

from elasticft.ckpt import shm


def trained_model(seed: int = 0, steps: int = 1) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for i in range(steps):
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(i))
        model(x).pow(2).mean().backward()
        optim.step()
        optim.zero_grad()
    return model, optim


def unique_prefix(local_rank: int = 0) -> str:
    """Segment names owned by this test process (swept if it dies)."""
    return shm.segment_prefix(os.getpid(), uuid.uuid4().hex[:8], local_rank)


def remove_segments(prefix: str) -> None:
    for path in shm.SHM_DIR.glob(f"{prefix}-s*"):
        path.unlink(missing_ok=True)
