"""A Lightning script recovered in process: one strategy object, and a failed rank costs the
others a roll-back, not their processes.

    elasticft-run --standalone --nproc-per-node 2 --max-restarts 3 \
        examples/train_lightning_inprocess.py

The only elasticft line is ``strategy=InProcessDDPStrategy()``. A tiny regression model on a
seeded dataset, Adam with a step scheduler, over two epochs, and a callback with a state of its
own (a count of batches, in Lightning's ``state_dict``). Faults for tests and demos:
``--crash-at-step N`` SIGKILLs ``--fault-rank`` (1) at the end of optimizer step N, after its
callbacks (so after ``ModelCheckpoint`` wrote step N) and before the snapshot of step N, in the
first attempt (the others redo step N). With ``--crash-in-checkpoint-write`` the fault is
instead in the write of step N's Lightning checkpoint, on the rank that writes it (rank 0;
``--fault-rank 0``): half its bytes are written, then the SIGKILL. ``--early-stopping`` adds
Lightning's ``EarlyStopping`` on the epoch's mean loss (patience 1), ``--lr-monitor`` a
``LearningRateMonitor`` (with a CSV logger into ``--log-dir``), ``--accumulate N`` the Trainer's
gradient accumulation, ``--resume-last`` calls ``fit(ckpt_path="last")`` as a script restarted by
a launcher does. ``--restart-mode`` trains with Lightning's own DDP strategy instead (the restart
mode, for comparison). ``--pytorch-lightning`` imports the
standalone ``pytorch_lightning`` package instead of ``lightning.pytorch``; the script is the same.
``--model-parallel`` shards the model with FSDP2 (``fully_shard`` in ``configure_model``) under
``InProcessModelParallelStrategy`` (Lightning's ``ModelParallelStrategy`` with
``--restart-mode``), or tensor parallel over every rank with ``--tensor-parallel`` too. Rank 0
writes the final (whole) parameters and its callback's count to ``--params-out``; every rank
appends a ``rank pid step`` line per optimizer step to ``--pid-log``.
"""

from __future__ import annotations

import argparse
import io
import os
import signal
import sys
from pathlib import Path

import torch
from torch.utils.data import DataLoader, TensorDataset

from elasticft.integrations.lightning import InProcessDDPStrategy, InProcessModelParallelStrategy

# One script for both packages (a user's script imports one of them), each imported as a
# script imports it at its top: the warm template imports it too (the condition is on the
# command line, which the template shares).
if "--pytorch-lightning" in sys.argv:
    import pytorch_lightning as L
else:
    import lightning.pytorch as L
ModelCheckpoint = L.callbacks.ModelCheckpoint
DDPStrategy, ModelParallelStrategy = L.strategies.DDPStrategy, L.strategies.ModelParallelStrategy


class Regression(L.LightningModule):
    def __init__(self, args: argparse.Namespace) -> None:
        super().__init__()
        # --dropout draws from torch's RNG, which a roll-back must put back too.
        self.net = torch.nn.Sequential(
            torch.nn.Linear(8, 32),
            torch.nn.Sequential(torch.nn.Tanh(), torch.nn.Dropout(args.dropout)),
            torch.nn.Linear(32, 1))
        self.args = args

    def configure_model(self) -> None:
        """Under a model-parallel strategy: tensor parallel over its tensor-parallel ranks,
        FSDP2 over its data-parallel ones. Called on every fit, so a module already
        parallelized is left as it is."""
        from torch.distributed.fsdp import FSDPModule, fully_shard
        from torch.distributed.tensor import DTensor
        from torch.distributed.tensor.parallel import (
            ColwiseParallel,
            RowwiseParallel,
            parallelize_module,
        )

        if not isinstance(self.trainer.strategy, ModelParallelStrategy) \
                or isinstance(self.net, FSDPModule) or isinstance(self.net[0].weight, DTensor):
            return
        mesh = self.device_mesh
        if mesh["tensor_parallel"].size() > 1:
            parallelize_module(self.net, mesh["tensor_parallel"],
                               {"0": ColwiseParallel(), "2": RowwiseParallel()},
                               src_data_rank=None)
        if mesh["data_parallel"].size() > 1:
            fully_shard(self.net, mesh=mesh["data_parallel"])

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        if self.args.early_stopping:
            self.log("train_loss", loss, on_step=False, on_epoch=True, sync_dist=True)
        return loss

    def on_train_batch_end(self, outputs: object, batch: object, batch_idx: int) -> None:
        """The fault: after the callbacks' hooks of step N (a checkpoint of it written), before
        its snapshot (at the next batch's start)."""
        first = os.environ.get("ELASTICFT_ATTEMPT", "0") == "0" and \
            os.environ.get("ELASTICFT_INPROCESS_GEN", "0") == "0"
        if first and self.trainer.global_rank == self.args.fault_rank \
                and self.trainer.global_step == self.args.crash_at_step \
                and not self.args.crash_in_checkpoint_write:
            os.kill(os.getpid(), signal.SIGKILL)

    def configure_optimizers(self) -> dict:
        optim = torch.optim.Adam(self.parameters(), lr=self.args.lr)
        sched = torch.optim.lr_scheduler.StepLR(optim, step_size=4, gamma=0.5)
        return {"optimizer": optim, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


class Batches(L.Callback):
    """Counts the batches started, a state of its own that Lightning checkpoints."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.started = 0
        self.step_at_start = 0

    def state_dict(self) -> dict[str, int]:
        return {"started": self.started}

    def load_state_dict(self, state_dict: dict[str, int]) -> None:
        self.started = state_dict["started"]

    def on_train_batch_start(self, trainer: L.Trainer, module: L.LightningModule, batch: object,
                             batch_idx: int) -> None:
        self.started += 1
        self.step_at_start = trainer.global_step

    def on_train_batch_end(self, trainer: L.Trainer, module: L.LightningModule, outputs: object,
                           batch: object, batch_idx: int) -> None:
        # A line per optimizer step (not per batch of an accumulated one).
        if self.args.pid_log and trainer.global_step != self.step_at_start:
            with open(self.args.pid_log, "a") as f:
                f.write(f"{trainer.global_rank} {os.getpid()} {trainer.global_step}\n")


class TornCheckpointIO(L.plugins.TorchCheckpointIO):
    """Lightning's checkpoint writer, killed half-way through the write of step N's file on
    the fault rank, in the first attempt (--crash-in-checkpoint-write)."""

    def __init__(self, args: argparse.Namespace) -> None:
        super().__init__()
        self.args = args

    def save_checkpoint(self, checkpoint: dict, path: str | Path,
                        storage_options: object = None) -> None:
        first = os.environ.get("ELASTICFT_ATTEMPT", "0") == "0" and \
            os.environ.get("ELASTICFT_INPROCESS_GEN", "0") == "0"
        rank = int(os.environ.get("RANK", "0"))
        if first and rank == self.args.fault_rank \
                and checkpoint.get("global_step") == self.args.crash_at_step:
            buffer = io.BytesIO()
            torch.save(checkpoint, buffer)
            Path(path).parent.mkdir(parents=True, exist_ok=True)
            with open(path, "wb") as f:
                f.write(buffer.getvalue()[: buffer.tell() // 2])
                f.flush()
            os.kill(os.getpid(), signal.SIGKILL)
        super().save_checkpoint(checkpoint, path, storage_options)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--lr", type=float, default=1e-2)
    parser.add_argument("--fault-rank", type=int, default=1)
    parser.add_argument("--crash-at-step", type=int, default=-1)
    parser.add_argument("--pid-log", type=Path)
    parser.add_argument("--params-out", type=Path)
    parser.add_argument("--dropout", type=float, default=0.0)
    parser.add_argument("--checkpoint-dir", type=Path,
                        help="Lightning's own ModelCheckpoint into this directory")
    parser.add_argument("--checkpoint-every", type=int, default=3,
                        help="steps; 0: at each epoch's end (ModelCheckpoint's default)")
    parser.add_argument("--save-last", action="store_true", help="ModelCheckpoint's save_last")
    parser.add_argument("--crash-in-checkpoint-write", action="store_true",
                        help="the fault in the write of step N's Lightning checkpoint")
    parser.add_argument("--early-stopping", action="store_true")
    parser.add_argument("--lr-monitor", action="store_true")
    parser.add_argument("--log-dir", type=Path, help="the CSV logger's (with --lr-monitor)")
    parser.add_argument("--accumulate", type=int, default=1)
    parser.add_argument("--pytorch-lightning", action="store_true",
                        help="import pytorch_lightning, not lightning.pytorch (read at import)")
    parser.add_argument("--restart-mode", action="store_true",
                        help="Lightning's own strategy: the restart mode, for comparison")
    parser.add_argument("--model-parallel", action="store_true",
                        help="FSDP2 under the model-parallel strategy instead of DDP")
    parser.add_argument("--tensor-parallel", action="store_true",
                        help="with --model-parallel: tensor parallel over every rank, not FSDP2")
    parser.add_argument("--resume-last", action="store_true",
                        help='fit(ckpt_path="last"): resume from the newest checkpoint '
                             "ModelCheckpoint wrote, as a script restarted by a launcher does")
    args = parser.parse_args()

    L.seed_everything(0, verbose=False)
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(48, 8, generator=generator)
    data = TensorDataset(x, x.sum(dim=1, keepdim=True).sin())
    model = Regression(args)
    batches = Batches(args)
    checkpoints = [ModelCheckpoint(dirpath=args.checkpoint_dir,
                                   every_n_train_steps=args.checkpoint_every or None,
                                   save_top_k=-1, save_last=args.save_last or None)
                   ] if args.checkpoint_dir else []
    if args.early_stopping:
        checkpoints.append(L.callbacks.EarlyStopping(monitor="train_loss", patience=1,
                                                     min_delta=0.02,
                                                     check_on_train_epoch_end=True))
    if args.lr_monitor:
        checkpoints.append(L.callbacks.LearningRateMonitor(logging_interval="step"))
    # (DDP's own checkpoint writer; the model-parallel strategy writes with DCP)
    checkpoint_io = TornCheckpointIO(args) if args.crash_in_checkpoint_write else None
    if args.model_parallel:
        ranks = int(os.environ.get("WORLD_SIZE", "1"))
        tensor = ranks if args.tensor_parallel else 1
        strategy: L.strategies.Strategy = (
            ModelParallelStrategy if args.restart_mode else InProcessModelParallelStrategy)(
            data_parallel_size=ranks // tensor, tensor_parallel_size=tensor)
    else:
        strategy = (DDPStrategy if args.restart_mode else InProcessDDPStrategy)(
            process_group_backend="gloo", checkpoint_io=checkpoint_io)
    trainer = L.Trainer(accelerator="cpu", devices=int(os.environ.get("LOCAL_WORLD_SIZE", "1")),
                        num_nodes=1, strategy=strategy, max_epochs=args.epochs,
                        logger=L.loggers.CSVLogger(args.log_dir or ".") if args.lr_monitor
                        else False, accumulate_grad_batches=args.accumulate,
                        enable_checkpointing=bool(args.checkpoint_dir), enable_progress_bar=False,
                        enable_model_summary=False, callbacks=[batches, *checkpoints])
    trainer.fit(model, DataLoader(data, batch_size=4, shuffle=True),
                ckpt_path="last" if args.resume_last else None)
    # Whole tensors: a sharded parameter is gathered (a collective, on every rank).
    params = {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().clone()
              for k, v in model.state_dict().items()}
    params["batches_started"] = torch.tensor(batches.started)
    if trainer.global_rank == 0:
        recoveries = getattr(getattr(strategy, "recovery", None), "recoveries", 0)
        print(f"finished {trainer.global_step} steps; {recoveries} in-process recoveries in "
              "this process", flush=True)
        if args.params_out:
            torch.save(params, args.params_out)


if __name__ == "__main__":
    main()
