"""A Hugging Face Trainer script recovered in process: one line, and a failed rank costs the
others a roll-back, not their processes.

    elasticft-run --standalone --nproc-per-node 2 --max-restarts 3 examples/train_hf_inprocess.py

The only elasticft line is ``train(trainer)`` in place of ``trainer.train()``. A tiny
regression model on a seeded dataset, the Trainer's AdamW and linear schedule, over two epochs,
on CPU. Faults for tests and demos: ``--crash-at-step N`` SIGKILLs ``--fault-rank`` (1) at
the end of optimizer step N, before its snapshot, in the first attempt (the others redo it).
Rank 0 writes the final parameters to ``--params-out``; every rank appends ``rank pid step``
lines to ``--pid-log``. ``--restart-mode`` calls ``trainer.train()`` instead (the restart mode,
for comparison).
"""

from __future__ import annotations

import argparse
import os
import signal
from pathlib import Path

import torch
from transformers import Trainer, TrainerCallback, TrainingArguments

from elasticft.integrations.hf import train


class Regression(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(),
                                       torch.nn.Linear(32, 1))

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
        out = self.net(x)
        return {"loss": torch.nn.functional.mse_loss(out, labels), "logits": out}


class Pairs(torch.utils.data.Dataset):
    def __init__(self) -> None:
        self.x = torch.randn(48, 8, generator=torch.Generator().manual_seed(0))
        self.y = self.x.sum(dim=1, keepdim=True).sin()

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"x": self.x[i], "labels": self.y[i]}


class Faults(TrainerCallback):
    """Kills a rank at a step, and logs each rank's process at each step."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.rank = int(os.environ.get("RANK", "0"))

    def on_step_end(self, args: TrainingArguments, state: object, control: object,
                    **kwargs: object) -> None:
        step = state.global_step  # type: ignore[attr-defined]
        if self.args.pid_log:
            with open(self.args.pid_log, "a") as f:
                f.write(f"{self.rank} {os.getpid()} {step}\n")
        first = os.environ.get("ELASTICFT_ATTEMPT", "0") == "0" and \
            os.environ.get("ELASTICFT_INPROCESS_GEN", "0") == "0"
        if first and self.rank == self.args.fault_rank and step == self.args.crash_at_step:
            os.kill(os.getpid(), signal.SIGKILL)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--fault-rank", type=int, default=1)
    parser.add_argument("--crash-at-step", type=int, default=-1)
    parser.add_argument("--pid-log", type=Path)
    parser.add_argument("--params-out", type=Path)
    parser.add_argument("--output-dir", type=Path, default=Path("hf-output"))
    parser.add_argument("--save-steps", type=int, default=0,
                        help="the Trainer's own checkpoints every N steps (0: none)")
    parser.add_argument("--restart-mode", action="store_true",
                        help="trainer.train() as it is: the restart mode, for comparison")
    args = parser.parse_args()

    torch.manual_seed(0)
    model = Regression()
    training = TrainingArguments(
        output_dir=str(args.output_dir), per_device_train_batch_size=4,
        num_train_epochs=args.epochs, learning_rate=1e-2, report_to=[],
        save_strategy="steps" if args.save_steps else "no", save_steps=args.save_steps or 500,
        use_cpu=True, seed=0, logging_steps=1000, disable_tqdm=True, ddp_backend="gloo",
        ddp_find_unused_parameters=False)
    trainer = Trainer(model=model, args=training, train_dataset=Pairs(),
                      callbacks=[Faults(args)])
    if args.restart_mode:
        trainer.train()
    else:
        train(trainer)  # in place of trainer.train()
    if trainer.is_world_process_zero():
        print(f"finished {trainer.state.global_step} steps", flush=True)
        if args.params_out:
            torch.save({k: v.detach().clone() for k, v in model.state_dict().items()},
                       args.params_out)


if __name__ == "__main__":
    main()
