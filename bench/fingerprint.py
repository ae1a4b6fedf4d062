"""Fingerprint cost against the save's cost: one rank's snapshot of ~300 MB of parameters and
AdamW state in shared memory, fingerprinted as the agent does (``--ckpt-fingerprint-every``).

Per save it measures, in this one process: the training thread's time in ``save()`` and the
next optimizer step's pre-step wait (what checkpointing costs training), the background copy
into shared memory (the save's own cost), and the fingerprint of the complete snapshot (what
the agent's fingerprint thread spends; training processes spend nothing on it). The
fingerprint is the CRC-32 of every replicated byte, so it scales with the bytes read.

Usage: ``python bench/fingerprint.py --mb 300 --saves 5``
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def main() -> int:
    import torch

    from elasticft.ckpt import Checkpointer, WorkerSettings, capture
    from elasticft.ckpt.integrity.fingerprint import fingerprint_slot
    from elasticft.ckpt.memory import shm
    from tests.ckpt.helpers import remove_segments, unique_prefix

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", type=int, default=300,
                        help="MB of state per rank (parameters + AdamW's two moments)")
    parser.add_argument("--saves", type=int, default=5)
    args = parser.parse_args()
    torch.manual_seed(0)
    elements = args.mb * (1 << 20) // 4 // 3
    model = torch.nn.Linear(elements // 1024, 1024, bias=False)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
    prefix = unique_prefix()
    rows = []
    try:
        settings = WorkerSettings(shm_slots=prefix, agent_owned=True, slots=2)
        with Checkpointer(settings, optimizers=[optim], rank=0, world_size=1) as ckpt:
            reader = shm.SlotSet(prefix, 2)
            for step in range(1, args.saves + 2):
                model.weight.grad = torch.full_like(model.weight, 1e-3)
                stall_before = ckpt.stall_s
                optim.step()                   # waits for the previous copy still in flight
                began = time.perf_counter()
                request = ckpt.save(step, capture(model, optim, {"step": step}, rng=False))
                request.wait(600)
                copy_s = time.perf_counter() - began
                index, header = reader.newest()
                slot = reader.get(index)
                assert slot is not None and header.step == step
                began = time.perf_counter()
                fp = fingerprint_slot(slot, step, 0)
                fingerprint_s = time.perf_counter() - began
                assert fp is not None
                if step > 1:                    # the first save sizes its slot
                    rows.append((copy_s, ckpt.stall_s - stall_before, fingerprint_s,
                                 fp.nbytes))
            reader.close()
    finally:
        remove_segments(prefix)
    copy = statistics.median(r[0] for r in rows)
    stall = statistics.median(r[1] for r in rows)
    fingerprint = statistics.median(r[2] for r in rows)
    nbytes = rows[0][3]
    print(f"state per rank: {nbytes / 1e6:.0f} MB fingerprinted ({len(rows)} saves, medians)")
    print(f"save: background copy into shared memory {copy * 1e3:.0f} ms, training thread "
          f"{stall * 1e3:.1f} ms")
    print(f"fingerprint (agent's thread): {fingerprint * 1e3:.0f} ms, "
          f"{nbytes / fingerprint / 1e9:.2f} GB/s, {fingerprint / copy:.2f}x the save's copy")
    print("fingerprint on the training thread: 0 ms (the worker only lists its optimizer-owned "
          "items in the manifest)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
