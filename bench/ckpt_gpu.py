"""What a checkpoint of GPU state costs training: torch.save, dcp.async_save, elasticft, the floor.

One process, one GPU: an MLP with fused AdamW (about 4.8 GB of state at the default 400M
parameters), trained for ``--steps`` steps with a checkpoint every ``--every`` steps, and the same
steps without checkpoints just before each method (paired, so drift between methods cancels).
Printed per method, in one run:

* save(): the first two calls of the process apart (they may make and pin the memory slots),
  then the median of the later calls, on the training thread;
* extra/save: (steps with checkpoints - steps without) / saves, measured to the last step's end
  on the device: what training really lost, the device included;
* reported/save: what the method says it stalled (elasticft's ``stall_s``; for the others the
  call time, which is all they report);
* restore: from the method's own copy back into the live CUDA model and optimizer, in this
  process and in a fresh one (a new model and an optimizer without state, as after a crash;
  torch.save and elasticft);
* the floor: one device-to-host copy of the state into pinned memory (DMA), timed on the device.

elasticft runs twice: event-ordered (the next optimizer step waits on the device for the copy)
and with a staging buffer on the device (``gpu_staging_bytes``), when the GPU has room for it.

    python bench/ckpt_gpu.py [--params 400e6 --steps 20 --every 5]

bench/gpu_check.sh runs it. Without CUDA it says so and exits 0. ``--device cpu`` runs the same
code on the CPU (no floor, no staging), so that the script is known to work before GPU time is
spent on it (``tests/bench/test_ckpt_gpu_bench.py``). The table also goes to
``$OUT/ckpt_gpu.json`` when ``OUT`` is set. Not a test: the numbers are the machine's.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from elasticft.ckpt import Checkpointer, StateCapture, WorkerSettings  # noqa: E402
from elasticft.ckpt.memory.shm import SHM_DIR, segment_prefix  # noqa: E402


def build(params: float, device: str) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    width = 8192 if params >= 8192 * 8192 else 256
    layers = max(1, round(params / (width * width)))
    torch.manual_seed(0)
    blocks: list[torch.nn.Module] = []
    for _ in range(layers):
        blocks += [torch.nn.Linear(width, width), torch.nn.GELU()]
    model = torch.nn.Sequential(*blocks).to(device)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=device == "cuda")
    return model, optim


def synchronize() -> None:
    if torch.cuda.is_initialized():
        torch.cuda.synchronize()


def state_bytes(model: torch.nn.Module, optim: torch.optim.Optimizer) -> int:
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    for per_param in optim.state.values():
        total += sum(v.numel() * v.element_size() for v in per_param.values()
                     if isinstance(v, torch.Tensor))
    return total


def train(model: torch.nn.Module, optim: torch.optim.Optimizer, steps: int, every: int,
          save: Callable[[int], None] | None, batch: torch.Tensor) -> float:
    """Seconds for ``steps`` steps, measured to the end of the last one on the device."""
    synchronize()
    started = time.perf_counter()
    for step in range(1, steps + 1):
        model(batch).float().pow(2).mean().backward()
        optim.step()
        optim.zero_grad(set_to_none=True)
        if save is not None and step % every == 0:
            save(step)
    synchronize()
    return time.perf_counter() - started


def pinned_floor(model: torch.nn.Module, optim: torch.optim.Optimizer) -> float:
    tensors = [p.detach() for p in model.parameters()]
    for per_param in optim.state.values():
        tensors += [v for v in per_param.values() if isinstance(v, torch.Tensor) and v.is_cuda]
    hosts = [torch.empty(t.shape, dtype=t.dtype, pin_memory=True) for t in tensors]
    times = []
    for _ in range(3):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for host, t in zip(hosts, tensors, strict=True):
            host.copy_(t, non_blocking=True)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1000)
    return min(times)


class Method:
    name = ""

    def __init__(self) -> None:
        self.call_s: list[float] = []

    def save(self, step: int) -> None:
        started = time.perf_counter()
        self._save(step)
        self.call_s.append(time.perf_counter() - started)

    def _save(self, step: int) -> None:
        raise NotImplementedError

    def reported_s(self) -> float:
        return sum(self.call_s)

    def restore(self) -> None:
        raise NotImplementedError

    def fresh_restore_spec(self) -> str | None:
        """What a fresh process restores from (see :func:`fresh_restore`); None: not measured."""
        return None

    def notes(self) -> str:
        return ""

    def close(self) -> None:
        pass


class TorchSave(Method):
    name = "torch.save"

    def __init__(self, model: torch.nn.Module, optim: torch.optim.Optimizer, tmp: Path) -> None:
        super().__init__()
        self.model, self.optim, self.path = model, optim, tmp / "torch_save.pt"

    def _save(self, step: int) -> None:
        torch.save({"model": self.model.state_dict(), "optim": self.optim.state_dict()},
                   self.path)

    def restore(self) -> None:
        torch_load(self.path, self.model, self.optim)

    def fresh_restore_spec(self) -> str | None:
        return f"torch.save:{self.path}"


class DcpAsyncSave(Method):
    name = "dcp.async_save"

    def __init__(self, model: torch.nn.Module, optim: torch.optim.Optimizer, tmp: Path) -> None:
        super().__init__()
        self.model, self.optim, self.tmp = model, optim, tmp
        self.future: Any = None
        self.last: Path | None = None

    def _state(self) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import get_state_dict

        model_sd, optim_sd = get_state_dict(self.model, self.optim)
        return {"model": model_sd, "optim": optim_sd}

    def _save(self, step: int) -> None:
        import torch.distributed.checkpoint as dcp

        if self.future is not None:
            self.future.result()
        self.last = self.tmp / f"dcp_{step}"
        self.future = dcp.async_save(self._state(), checkpoint_id=str(self.last))

    def restore(self) -> None:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import set_state_dict

        self.close()
        state = self._state()
        dcp.load(state, checkpoint_id=str(self.last))
        set_state_dict(self.model, self.optim, model_state_dict=state["model"],
                       optim_state_dict=state["optim"])

    def close(self) -> None:
        if self.future is not None:
            self.future.result()
            self.future = None


class Elasticft(Method):
    def __init__(self, model: torch.nn.Module, optim: torch.optim.Optimizer,
                 staging_bytes: int) -> None:
        super().__init__()
        self.name = "elasticft, staged" if staging_bytes else "elasticft"
        self.model, self.optim = model, optim
        self.prefix = segment_prefix(os.getpid(), f"bench{staging_bytes}", 0)
        settings = WorkerSettings(shm_slots=self.prefix, agent_owned=True,
                                  gpu_staging_bytes=staging_bytes)
        self.ckpt = Checkpointer(settings, optimizers=[optim])
        self.capture = StateCapture(model, optim, rng=False)
        self.last: Any = None

    def _save(self, step: int) -> None:
        self.last = self.ckpt.save(step, self.capture(extra={"step": step}))

    def reported_s(self) -> float:
        # The last copy lands after the loop; waiting for it here is not training's loss, so
        # the request is waited for directly, not through the checkpointer's counted waits.
        # (The steps without saves before it cost nothing: no copy was in flight.)
        if self.last is not None:
            self.last.wait(600)
        synchronize()
        return self.ckpt.stall_s

    def restore(self) -> None:
        assert self.ckpt.restore(self.model, self.optim) is not None

    def fresh_restore_spec(self) -> str | None:
        return f"elasticft:{self.prefix}"

    def notes(self) -> str:
        device = self.ckpt._device
        if device is None:
            return "device path off: " + (self.ckpt._device_off or "no CUDA state")
        pinned = "pinned" if device.pin_refused is None else f"NOT pinned ({device.pin_refused})"
        staged = "" if device.staging_refused is None else f", staging refused: " \
            f"{device.staging_refused}"
        return pinned + staged

    def close(self) -> None:
        self.ckpt.close()
        for path in SHM_DIR.glob(f"{self.prefix}-s*"):
            path.unlink(missing_ok=True)


def torch_load(path: Path, model: torch.nn.Module, optim: torch.optim.Optimizer) -> None:
    device = next(model.parameters()).device
    state = torch.load(path, map_location=device, weights_only=True)
    model.load_state_dict(state["model"])
    optim.load_state_dict(state["optim"])


def fresh_restore(spec: str, args: argparse.Namespace) -> float | None:
    """Seconds a fresh process takes to restore ``spec`` into a new model and an optimizer
    without state (the process's start-up and model construction not counted)."""
    done = subprocess.run(
        [sys.executable, __file__, "--restore-in-this-process", spec, "--params",
         str(args.params), "--device", args.device],
        capture_output=True, text=True, timeout=900)
    if done.returncode != 0:
        print(f"ckpt_gpu: the fresh restore of {spec} failed:\n{done.stderr[-2000:]}",
              file=sys.stderr)
        return None
    return float(json.loads(done.stdout.splitlines()[-1])["restore_s"])


def restore_in_this_process(spec: str, args: argparse.Namespace) -> int:
    """The fresh process of :func:`fresh_restore`: prints ``{"restore_s": ...}``."""
    kind, where = spec.split(":", 1)
    model, optim = build(args.params, args.device)
    synchronize()
    started = time.perf_counter()
    if kind == "torch.save":
        torch_load(Path(where), model, optim)
    else:
        settings = WorkerSettings(shm_slots=where, agent_owned=True)
        ckpt = Checkpointer(settings, optimizers=[optim])
        assert ckpt.restore(model, optim) is not None, f"nothing to restore in {where}"
    synchronize()
    seconds = time.perf_counter() - started
    if kind != "torch.save":
        ckpt.close()
    print(json.dumps({"restore_s": seconds}))
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--params", type=float, default=400e6)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--every", type=int, default=5)
    parser.add_argument("--batch", type=int, default=2048)
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                        help="cpu: the same code on the CPU, to check the script itself")
    parser.add_argument("--restore-in-this-process", metavar="KIND:WHERE",
                        help=argparse.SUPPRESS)  # the fresh process of a restore
    args = parser.parse_args()
    if args.restore_in_this_process:
        return restore_in_this_process(args.restore_in_this_process, args)
    on_gpu = args.device == "cuda"
    if on_gpu and not torch.cuda.is_available():
        print(f"ckpt_gpu: no CUDA device (torch {torch.__version__}); nothing measured")
        return 0
    model, optim = build(args.params, args.device)
    batch = torch.randn(args.batch, model[0].in_features, device=args.device)
    train(model, optim, 2, args.every, None, batch)  # optimizer state exists from here on
    nbytes = state_bytes(model, optim)
    shm_free = shutil.disk_usage(SHM_DIR).free
    if 2 * nbytes + (64 << 20) > shm_free:
        print(f"ckpt_gpu: {SHM_DIR} has {shm_free >> 20} MiB free, two snapshots of "
              f"{nbytes >> 20} MiB need more; run with a smaller --params")
        return 1
    free_device = torch.cuda.mem_get_info()[0] if on_gpu else 0
    saves = args.steps // args.every
    floor = pinned_floor(model, optim) if on_gpu else None
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="ckpt_gpu_") as tmp_name:
        tmp = Path(tmp_name)
        makers: list[Callable[[], Method]] = [
            lambda: TorchSave(model, optim, tmp),
            lambda: DcpAsyncSave(model, optim, tmp),
            lambda: Elasticft(model, optim, 0),
        ]
        if on_gpu and free_device > nbytes + (2 << 30):
            makers.append(lambda: Elasticft(model, optim, nbytes + (64 << 20)))
        for make in makers:
            method = make()
            try:
                plain = train(model, optim, args.steps, args.every, None, batch)
                with_saves = train(model, optim, args.steps, args.every, method.save, batch)
                reported = method.reported_s()
                synchronize()
                started = time.perf_counter()
                method.restore()
                synchronize()
                restore_s = time.perf_counter() - started
                spec = method.fresh_restore_spec()
                later = method.call_s[2:] or method.call_s
                rows.append({
                    "method": method.name,
                    "first_saves_ms": [1000 * s for s in method.call_s[:2]],
                    "save_call_ms": 1000 * statistics.median(later),
                    "fresh_restore_s": fresh_restore(spec, args) if spec else None,
                    "extra_per_save_ms": 1000 * (with_saves - plain) / saves,
                    "reported_per_save_ms": 1000 * reported / saves,
                    "restore_s": restore_s,
                    "step_ms": 1000 * plain / args.steps,
                    "notes": method.notes(),
                })
            finally:
                method.close()
    when = f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC"
    where = torch.cuda.get_device_name(0) if on_gpu else "CPU (a check of the script)"
    floor_text = (f"pinned DMA floor {1000 * floor:.1f} ms ({nbytes / floor / 1e9:.0f} GB/s)"
                  if floor else "no DMA floor on the CPU")
    print(f"ckpt_gpu: {where}, torch {torch.__version__}, {when}; state {nbytes / 1e6:.1f} MB, "
          f"{args.steps} steps, a save every {args.every}; {floor_text}")
    print(f"{'method':<20} {'1st, 2nd save()':>16} {'later save()':>13} {'extra/save':>11} "
          f"{'reported/save':>14} {'restore':>9} {'fresh proc':>10} {'step':>8}  notes")
    for r in rows:
        first = ", ".join(f"{ms:.1f}" for ms in r["first_saves_ms"]) + "ms"
        fresh = "-" if r["fresh_restore_s"] is None else f"{r['fresh_restore_s']:.3f}s"
        print(f"{r['method']:<20} {first:>16} {r['save_call_ms']:>11.1f}ms "
              f"{r['extra_per_save_ms']:>9.1f}ms {r['reported_per_save_ms']:>12.1f}ms "
              f"{r['restore_s']:>8.3f}s {fresh:>10} {r['step_ms']:>6.1f}ms  {r['notes']}")
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "ckpt_gpu.json").write_text(json.dumps(
            {"when": when, "state_bytes": nbytes, "floor_s": floor, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
