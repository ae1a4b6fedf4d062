"""Small shared pieces of the checkpoint tests: a model with optimizer state, unique shm names."""

from __future__ import annotations

import os
import uuid
from typing import Any

import torch

from elasticft.ckpt.memory import shm


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


# What tests look at inside a DeviceCopier (elasticft.ckpt.memory.device); nothing outside needs it.

def wait_pinned(copier: Any, timeout_s: float = 60.0) -> None:
    """Waits for the copier's slot registrations under way (they run on a thread)."""
    with copier._pin_lock:
        pending = [entry[2] for entry in copier._pinning.values()]
    for done in pending:
        done.wait(timeout_s)


def pinned_slots(copier: Any) -> int:
    """How many slots the copier holds registered (pinned) now."""
    with copier._pin_lock:
        return len(copier._pinned)


def waits_pending(copier: Any) -> int:
    """How many training-stream waits the copier has not yet counted as stall."""
    with copier._waits_lock:
        return len(copier._waits)
