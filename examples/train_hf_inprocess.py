"""A Hugging Face Trainer script recovered in process: one line, and a failed rank costs the
others a roll-back, not their processes.

    elasticft-run --standalone --nproc-per-node 2 --max-restarts 3 examples/train_hf_inprocess.py

The only elasticft line is ``train(trainer)`` in place of ``trainer.train()``. A tiny
regression model on a seeded dataset (``--model gpt2``: a one-layer GPT-2 with dropout on
seeded tokens), the Trainer's AdamW and linear schedule, over two epochs, on CPU; options add
gradient accumulation, a warmup, evaluations, a callback with its own state, accelerate's
unseeded sampler. Faults for tests and demos: ``--crash-at-step N`` SIGKILLs ``--fault-rank``
(1) at the end of optimizer step N, before its snapshot, in the first attempt (the others redo
it); with ``--crash-in-checkpoint-write`` it is killed instead inside the Trainer's write of
step N's checkpoint (``--save-steps``), its model written and its optimizer not yet (rank 0,
the rank that writes: ``--fault-rank 0``). Rank 0 writes the final parameters to
``--params-out``; every rank appends ``rank pid step`` lines to ``--pid-log``.
``--restart-mode`` calls ``trainer.train()`` instead (the restart mode, for comparison).
"""

from __future__ import annotations

import argparse
import os
import signal
from pathlib import Path

import torch
from transformers import Trainer, TrainerCallback, TrainingArguments
from transformers.trainer_callback import ExportableState

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


class Tokens(torch.utils.data.Dataset):
    """Seeded random token sequences for a causal language model (labels: the inputs)."""

    def __init__(self, vocab: int) -> None:
        self.ids = torch.randint(0, vocab, (48, 16), generator=torch.Generator().manual_seed(0))

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def tiny_gpt2() -> torch.nn.Module:
    """A one-layer GPT-2 with GPT2Config's default dropout (0.1 on residuals, embeddings and
    attention): every training step draws from torch's RNG."""
    from transformers import GPT2Config, GPT2LMHeadModel

    return GPT2LMHeadModel(GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=1,
                                      n_head=2, bos_token_id=0, eos_token_id=0))


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
        if first and self.rank == self.args.fault_rank and step == self.args.crash_at_step \
                and not self.args.crash_in_checkpoint_write:
            os.kill(os.getpid(), signal.SIGKILL)


def kill_in_checkpoint_write(trainer: Trainer, args: argparse.Namespace) -> None:
    """--crash-in-checkpoint-write: the fault rank is killed between the Trainer's write of
    step N's model and of its optimizer, in the first attempt."""
    save = trainer._save_optimizer_and_scheduler
    rank = int(os.environ.get("RANK", "0"))

    def killed_half_way(output_dir: str) -> None:
        first = os.environ.get("ELASTICFT_ATTEMPT", "0") == "0" and \
            os.environ.get("ELASTICFT_INPROCESS_GEN", "0") == "0"
        if first and rank == args.fault_rank and \
                trainer.state.global_step == args.crash_at_step:
            os.kill(os.getpid(), signal.SIGKILL)
        save(output_dir)

    trainer._save_optimizer_and_scheduler = killed_half_way  # type: ignore[method-assign]


class Counts(TrainerCallback, ExportableState):
    """A callback with a state of its own, which the Trainer's checkpoints keep: the steps it
    saw begin and end. A recovery rolls it back with the step."""

    def __init__(self) -> None:
        self.began = self.ended = 0

    def state(self) -> dict:
        return {"args": {}, "attributes": {"began": self.began, "ended": self.ended}}

    def on_step_begin(self, args: TrainingArguments, state: object, control: object,
                      **kwargs: object) -> None:
        self.began += 1

    def on_step_end(self, args: TrainingArguments, state: object, control: object,
                    **kwargs: object) -> None:
        self.ended += 1


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--model", choices=("regression", "gpt2"), default="regression",
                        help="gpt2: a tiny GPT-2 with dropout (its RNG is rolled back too)")
    parser.add_argument("--fault-rank", type=int, default=1)
    parser.add_argument("--crash-at-step", type=int, default=-1)
    parser.add_argument("--crash-in-checkpoint-write", action="store_true",
                        help="the fault inside the write of step N's checkpoint")
    parser.add_argument("--pid-log", type=Path)
    parser.add_argument("--params-out", type=Path)
    parser.add_argument("--output-dir", type=Path, default=Path("hf-output"))
    parser.add_argument("--save-steps", type=int, default=0,
                        help="the Trainer's own checkpoints every N steps (0: none)")
    parser.add_argument("--eval-steps", type=int, default=0,
                        help="evaluate on the training set every N steps (0: never)")
    parser.add_argument("--grad-accum", type=int, default=1,
                        help="batches per optimizer step (gradient accumulation)")
    parser.add_argument("--warmup-steps", type=int, default=0,
                        help="the linear schedule's warmup")
    parser.add_argument("--count-steps", action="store_true",
                        help="a callback with its own state (Counts); every rank prints it")
    parser.add_argument("--shuffle-from-torch-rng", action="store_true",
                        help="accelerate's sampler without its own seed: each epoch's order is "
                        "drawn from torch's RNG")
    parser.add_argument("--restart-mode", action="store_true",
                        help="trainer.train() as it is: the restart mode, for comparison")
    args = parser.parse_args()

    torch.manual_seed(0)
    model = Regression() if args.model == "regression" else tiny_gpt2()
    training = TrainingArguments(
        output_dir=str(args.output_dir), per_device_train_batch_size=4,
        num_train_epochs=args.epochs, learning_rate=1e-2, report_to=[],
        save_strategy="steps" if args.save_steps else "no", save_steps=args.save_steps or 500,
        use_cpu=True, seed=0, logging_steps=1000, disable_tqdm=True, ddp_backend="gloo",
        ddp_find_unused_parameters=False, gradient_accumulation_steps=args.grad_accum,
        warmup_steps=args.warmup_steps, eval_strategy="steps" if args.eval_steps else "no",
        eval_steps=args.eval_steps or None,
        accelerator_config={"use_seedable_sampler": not args.shuffle_from_torch_rng})
    dataset = Pairs() if args.model == "regression" else Tokens(64)
    trainer = Trainer(model=model, args=training, train_dataset=dataset,
                      eval_dataset=dataset if args.eval_steps else None,
                      callbacks=[Faults(args), *([Counts()] if args.count_steps else [])])
    if args.crash_in_checkpoint_write:
        kill_in_checkpoint_write(trainer, args)
    if args.restart_mode:
        trainer.train()
    else:
        train(trainer)  # in place of trainer.train()
    for callback in trainer.callback_handler.callbacks:
        if isinstance(callback, Counts):  # the Trainer's resume may have made it again
            print(f"rank {trainer.args.process_index} counted {callback.began} step begins, "
                  f"{callback.ended} step ends", flush=True)
    if trainer.is_world_process_zero():
        print(f"finished {trainer.state.global_step} steps", flush=True)
        if args.params_out:
            torch.save({k: v.detach().clone() for k, v in model.state_dict().items()},
                       args.params_out)


if __name__ == "__main__":
    main()
