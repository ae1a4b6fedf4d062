"""The training of train_elasticft.py, recovered in process: when a rank fails, the others keep
their processes, roll back in place and go on with a replacement for the failed one.

The difference from train_elasticft.py is where things are built. The model, the optimizer and
the checkpointer are built once; what is bound to the process group (DDP) and the restore go in
``train``, which ``InProcess().run`` re-enters after a peer failed:

    elasticft-run --standalone --nproc-per-node 2 --max-restarts 3 examples/train_inprocess.py

On several nodes (etcd-v3, a third agent started the same way waits as a standby), a lost node
costs the survivors no process either: the standby's worker takes the lost rank.

    elasticft-run --nnodes 2:2 --nproc-per-node 1 --rdzv-backend etcd-v3 \
        --rdzv-endpoint HOST:2379 --rdzv-id JOB examples/train_inprocess.py

Faults for tests and demos, injected once by --fault-rank in the first attempt:
--crash-at-step N (SIGKILL right after the save of step N; --crash-mode after-save waits for
it to complete, before-save kills before it, so the others redo step N; before-save-after-peers
kills before it once the other ranks' saves of step N are whole; keep-sockets waits too,
and first forks a child outside the job that keeps the rank's sockets open, so the survivors'
collective never fails by itself: the child writes its pid to --keeper-pid and lives 300 s),
--hang-at-step N (SIGSTOP), --corrupt-restore (the failed rank's replacement changes one bit of
a parameter after its restore, as a torn copy would), --crash-again-after-recovery (a process
that recovered in process, once it redid --crash-at-step's optimizer step and the agent logged
the recovery done, stops itself (SIGSTOP) before that step's save: a hang each roll-back in the
same processes brings back, which only a restart of every rank clears),
--infra-error-at-step N (raises a connection error before step N;
with --exit-after-failed the rank then exits right after reporting it, before its teardown; with
--stuck-teardown its teardown never returns; with --sick-device its device fails the health
check), and --replacement-fails (a replacement process exits at once, which makes the agent fall
back to a full restart). --manual-sgd trains without a torch.optim optimizer and tells InProcess
of each step (InProcess.step_done). A second fault on another rank: --gil-hold-rank R
--gil-hold-at-step N has rank R, after the save of step N, enter a C call that holds the GIL for
an hour (a main thread, and a monitor thread, that never run again), in the first attempt.

Scripts as users write them: --wrong-after-interrupt all-reduces the gradients in a DDP comm
hook that, when the all-reduce fails, returns them filled with garbage instead of raising (what
an aborted NCCL kernel does; --wrong-log gets a 'rank pid step' line each time), and runs each
step, from its backward to its save, in InProcess.atomic(): only elasticft's gate keeps such a
step from being taken and saved. --swallow-exceptions retries a step that raised an Exception
(log and retry, as a script's `except Exception:` loop does): the interrupt still ends it.
--extra-group makes a second process group in each entry and all-reduces on it every step (a
group the recovery ends besides the default one). --own-store PORT and --own-echo PORT: before
run(), every rank connects its own TCP clients (a TCPStore client and a socket to an echo
server, both hosted outside the job); after its training each rank uses them again and appends
"RANK ok RECOVERIES" (or what failed) to --own-clients-log: a recovery leaves the script's own
connections alone.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import os
import signal
import socket
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel

sys.path.insert(0, str(Path(__file__).resolve().parent))
from train_plain import VOCAB, TinyGPT, batch, record_step, setup_device

from elasticft.ckpt import Checkpointer, StateCapture
from elasticft.inprocess import GroupOps, InProcess


def keep_sockets(pid_file: Path | None) -> None:
    """Forks a child that holds every descriptor of this process (its gloo connections too)
    in a session of its own, outside the job's process group, and lives on after this one."""
    child = os.fork()
    if child == 0:
        os.setsid()
        null = os.open(os.devnull, os.O_RDWR)
        for fd in (0, 1, 2):  # the launcher's pipes close when the job ends
            os.dup2(null, fd)
        if pid_file is not None:
            pid_file.write_text(str(os.getpid()))
        time.sleep(300)
        os._exit(0)
    while pid_file is not None and not pid_file.exists():
        time.sleep(0.01)


class OwnClients:
    """The script's own TCP clients, made before InProcess.run and used again after it."""

    def __init__(self, store_port: int, echo_port: int) -> None:
        self.store = dist.TCPStore("127.0.0.1", store_port, is_master=False,
                                   timeout=timedelta(seconds=30))
        self.echo = socket.create_connection(("127.0.0.1", echo_port), timeout=30)

    def check(self, key: str) -> str:
        """"ok" when both clients still work, else what failed."""
        try:
            self.store.set(key, "alive")
            assert self.store.get(key) == b"alive"
            self.echo.sendall(key.encode())
            assert self.echo.recv(len(key)) == key.encode()
            return "ok"
        except Exception as e:
            return f"{type(e).__name__}:{str(e).split()[0] if str(e) else ''}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--step-time", type=float, default=0.0, help="extra seconds per step")
    parser.add_argument("--step-time-at-step", type=int, default=-1,
                        help="spend --step-time after this step only (default: after every step)")
    parser.add_argument("--loss-log", type=Path, help="rank 0 appends 'step loss' lines here")
    parser.add_argument("--pid-log", type=Path, help="every rank appends 'rank pid step' here")
    parser.add_argument("--fault-rank", type=int, default=1)
    parser.add_argument("--crash-at-step", type=int, default=-1)
    parser.add_argument("--crash-mode",
                        choices=("mid-save", "after-save", "before-save",
                                 "before-save-after-peers", "keep-sockets"),
                        default="mid-save")
    parser.add_argument("--crash-again-after-recovery", action="store_true")
    parser.add_argument("--corrupt-restore", action="store_true")
    parser.add_argument("--hang-at-step", type=int, default=-1)
    parser.add_argument("--infra-error-at-step", type=int, default=-1)
    parser.add_argument("--manual-sgd", action="store_true",
                        help="update the parameters by hand instead of with a torch.optim "
                        "optimizer (and tell InProcess of each step)")
    parser.add_argument("--keeper-pid", type=Path, help="where keep-sockets' child writes its pid")
    parser.add_argument("--exit-after-failed", action="store_true")
    parser.add_argument("--stuck-teardown", action="store_true")
    parser.add_argument("--sick-device", action="store_true")
    parser.add_argument("--replacement-fails", action="store_true")
    parser.add_argument("--gil-hold-rank", type=int, default=-1)
    parser.add_argument("--gil-hold-at-step", type=int, default=-1)
    parser.add_argument("--wrong-after-interrupt", action="store_true",
                        help="a DDP comm hook returns garbage gradients when its all-reduce "
                        "fails; each step runs in InProcess.atomic()")
    parser.add_argument("--wrong-log", type=Path,
                        help="the comm hook appends 'rank pid step' for each garbage result")
    parser.add_argument("--swallow-exceptions", action="store_true",
                        help="retry a step that raised an Exception (except Exception:)")
    parser.add_argument("--extra-group", action="store_true")
    parser.add_argument("--own-store", type=int, help="port of a TCPStore hosted outside the job")
    parser.add_argument("--own-echo", type=int, help="port of an echo server outside the job")
    parser.add_argument("--own-clients-log", type=Path)
    parser.add_argument("--rank-seeded-noise", action="store_true",
                        help="seed torch's RNG by rank after the model is built (nanoGPT's "
                        "1337 + rank) and scale each step's loss by a draw from it: every "
                        "rank's RNG state is its own")
    parser.add_argument("--no-step-records", action="store_true",
                        help="write no step records: the report numbers the steps by the "
                        "optimizer's own count (elasticft's automatic records)")
    args = parser.parse_args()

    if args.replacement_fails and os.environ.get("ELASTICFT_INPROCESS_GEN", "0") != "0" \
            and os.environ.get("ELASTICFT_ATTEMPT") == os.environ.get("ELASTICFT_INPROCESS_GEN"):
        sys.exit("injected: the replacement fails to start")
    replacement = os.environ.get("ELASTICFT_INPROCESS_GEN", "0") != "0" \
        and os.environ.get("ELASTICFT_ATTEMPT") == os.environ.get("ELASTICFT_INPROCESS_GEN")
    device = setup_device()  # init_process_group; no collective before InProcess().run
    rank = dist.get_rank()
    torch.manual_seed(0)
    net = TinyGPT(dim=args.dim, layers=args.layers).to(device)
    optim = None if args.manual_sgd else torch.optim.AdamW(net.parameters(), lr=args.lr)
    ckpt = Checkpointer.from_env(optimizers=[optim] if optim is not None else [])
    snapshot = StateCapture(net, optim)
    if args.rank_seeded_noise:
        torch.manual_seed(1337 + rank)
    first_attempt = os.environ.get("ELASTICFT_ATTEMPT", "0") == "0"
    faults = {"armed": first_attempt and rank == args.fault_rank,
              "gil": first_attempt and rank == args.gil_hold_rank}
    own = OwnClients(args.own_store, args.own_echo) if args.own_store else None

    ops = GroupOps.for_torch()
    if args.exit_after_failed and faults["armed"]:
        ops.destroy = lambda: os._exit(1)  # injected: dies after its `failed` record
    if args.stuck_teardown and faults["armed"]:
        ops.destroy = lambda: time.sleep(3600)  # injected: a teardown that never returns
    if args.sick_device and faults["armed"]:
        ops.health = lambda limit_s, device: "injected: the device is lost"
    recovery = InProcess(ops=ops)

    def all_reduce_or_garbage(state, bucket):
        """DDP's all-reduce (the sum of the gradients divided by the world size), except that a
        failed one returns garbage, as an aborted NCCL kernel leaves its buffer, not an error.
        (No annotations: DDP compares them with its own classes, and this module's are
        strings.) ``state``: the hook's state, [the step being taken, rank, world size], read
        before the step: after an abort torch's table of groups is gone, and with it
        ``dist.get_rank()``."""
        step, rank, world = state
        buffer = bucket.buffer()
        try:
            buffer.div_(world)
            dist.all_reduce(buffer)
        except Exception:
            buffer.fill_(1e3)
            if args.wrong_log:
                with open(args.wrong_log, "a") as f:
                    f.write(f"{rank} {os.getpid()} {step}\n")
        done: torch.futures.Future[torch.Tensor] = torch.futures.Future()
        done.set_result(buffer)
        return done

    def train() -> None:
        rank = dist.get_rank()  # read here: a spare takes its rank in InProcess().run
        current = [0, rank, dist.get_world_size()]  # the comm hook's state
        if args.wrong_after_interrupt:  # the buffer (a constant mask) needs no broadcast
            model = DistributedDataParallel(net, broadcast_buffers=False)
            model.register_comm_hook(current, all_reduce_or_garbage)
        else:
            model = DistributedDataParallel(net)  # bound to this generation's process group
        extra = dist.new_group() if args.extra_group else None
        start = 0
        restored = ckpt.restore(net, optim)  # in place, into the live tensors
        if args.corrupt_restore and replacement and rank == args.fault_rank:
            with torch.no_grad():  # injected: one bit of one parameter, as a torn copy
                first = next(net.parameters()).view(-1)
                first[:1] = first[:1].view(torch.int32).bitwise_xor(1).view(first.dtype)
        if restored is not None:
            start, _ = restored
            if rank == 0:
                print(f"resumed from step {start} (source={ckpt.last_source})", flush=True)
        for step in range(start, args.steps):
            current[0] = step + 1
            failures = 0
            while True:
                try:
                    if failures:
                        time.sleep(0.1)  # a back-off before the retry, inside the `try`
                    with recovery.atomic() if args.wrong_after_interrupt \
                            else contextlib.nullcontext():
                        one_step(model, extra, rank, step)
                    break
                except Exception as e:  # the interrupt is no Exception: it is not caught
                    if not args.swallow_exceptions:
                        raise
                    failures += 1
                    print(f"rank {rank}: step {step + 1} failed, retried: "
                          f"{type(e).__name__}: {e}".splitlines()[0], flush=True)

    def one_step(model: DistributedDataParallel, extra: Any, rank: int, step: int) -> None:
        if faults["armed"] and step + 1 == args.infra_error_at_step:
            faults["armed"] = False
            raise ConnectionResetError("injected: connection reset by peer (NIC flap)")
        x, y = (t.to(device) for t in batch(step, rank, args.batch_size))
        loss = F.cross_entropy(model(x).reshape(-1, VOCAB), y.reshape(-1))
        if args.rank_seeded_noise:
            loss = loss * (1 + 1e-2 * torch.rand((), device=device))
        if extra is not None:
            dist.all_reduce(torch.ones(1), group=extra)
        if optim is None:
            net.zero_grad(set_to_none=True)
            loss.backward()
            with torch.no_grad():
                for p in net.parameters():
                    p -= args.lr * p.grad
            recovery.step_done()
        else:
            optim.zero_grad(set_to_none=True)
            loss.backward()
            optim.step()
        done = step + 1
        if rank == 0:
            value = loss.item()
            print(f"step {done} loss {value:.6f}", flush=True)
            if args.loss_log:
                with open(args.loss_log, "a") as f:
                    f.write(f"{done} {value!r}\n")
        if args.pid_log:
            with open(args.pid_log, "a") as f:
                f.write(f"{rank} {os.getpid()} {done}\n")
        peers_first = (args.crash_mode == "before-save-after-peers"
                       and done == args.crash_at_step and recovery.generation == 0)
        if faults["armed"] and done == args.crash_at_step \
                and args.crash_mode in ("before-save", "before-save-after-peers"):
            if peers_first:
                dist.barrier()  # the others enter once their step-N snapshot is whole
            os.kill(os.getpid(), signal.SIGKILL)
        if args.crash_again_after_recovery and recovery.recoveries and done == args.crash_at_step:
            run_dir = Path(os.environ["ELASTICFT_RUN_DIR"])
            while not any('"kind":"recover_in_process"' in events.read_text()
                          for events in run_dir.glob("events-*.jsonl")):
                time.sleep(0.05)
            os.kill(os.getpid(), signal.SIGSTOP)
        request = ckpt.save(done, snapshot(extra={"step": done}))
        if peers_first:  # not the failing rank: its step N is whole before the failure
            request.wait()
            dist.barrier()
        if not args.no_step_records:
            record_step(done, 0.0)
        if faults["armed"] and done == args.crash_at_step:
            if args.crash_mode in ("after-save", "keep-sockets"):
                request.wait()
                time.sleep(1.0)  # the others wait in the next step's collective
            if args.crash_mode == "keep-sockets":
                keep_sockets(args.keeper_pid)
            os.kill(os.getpid(), signal.SIGKILL)
        if faults["gil"] and done == args.gil_hold_at_step:
            request.wait()
            ctypes.PyDLL(None).sleep(3600)  # PyDLL: the GIL stays held in the call
        if faults["armed"] and done == args.hang_at_step:
            request.wait()
            os.kill(os.getpid(), signal.SIGSTOP)
        if args.step_time and args.step_time_at_step in (-1, done):
            time.sleep(args.step_time)

    recovery.run(train)
    rank = dist.get_rank()
    if own is not None and args.own_clients_log:
        with open(args.own_clients_log, "a") as f:
            f.write(f"{rank} {own.check(f'rank-{rank}')} {recovery.recoveries}\n")
    ckpt.close()
    dist.barrier()
    if rank == 0:
        print(f"finished {args.steps} steps; {recovery.recoveries} in-process recoveries in "
              f"this process", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
