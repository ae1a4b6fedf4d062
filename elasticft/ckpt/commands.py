"""``elasticft ckpt ls|verify|export``: look at, check and hand over durable checkpoints.

* ``ls DIR``: every step directory with its state (committed, DCP-readable, torn), ranks, size.
* ``verify DIR [--step N]``: re-reads every shard of a committed step and checks each blob's
  CRC-32; exit code 1 when something is corrupt or missing.
* ``export DIR --out PATH [--step N] [--format dcp|torch]``: a plain DCP directory (only
  ``.metadata`` and the shard files) or a single ``torch.save`` file of the whole, unsharded state
  (torch's ``dcp_to_torch_save``). Every shard is verified first; a damaged step is not exported.
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

from elasticft.ckpt.api import CheckpointError
from elasticft.ckpt.persisting import durable


def _error(message: str) -> Exception:
    from elasticft.cli import CliError

    return CliError(message)


def _pick_step(root: Path, step: int | None) -> tuple[int, Path]:
    committed = durable.committed_steps(root)
    if not committed:
        raise _error(f"no committed checkpoint under {root}; give the checkpoint directory "
                     "(the parent of the step-* directories)")
    if step is None:
        step = max(committed)
    if step not in committed:
        raise _error(f"step {step} is not committed under {root}; committed: "
                     f"{', '.join(map(str, sorted(committed)))}")
    return step, durable.step_dir(root, step)


def _cmd_ls(args: argparse.Namespace) -> int:
    root: Path = args.dir
    steps = durable.list_steps(root)
    if not steps:
        raise _error(f"no step-* directories under {root}")
    rows = []
    for step, directory in sorted(steps.items()):
        info = durable.commit_info(directory)
        size = sum(p.stat().st_size for p in directory.iterdir() if p.is_file())
        ranks = sorted(int(p.stem[1:]) for p in directory.glob("r*.json"))
        state = "torn" if info is None else ("committed+dcp" if info.get("dcp") else "committed")
        rows.append({"step": step, "state": state, "ranks": ranks, "bytes": size,
                     "world_size": info.get("world_size") if info else None,
                     "path": str(directory)})
    if args.json:
        print(json.dumps(rows, indent=2))
    else:
        print(f"{'step':>10}  {'state':<14} {'world':>5}  {'ranks':<12} {'size':>10}  path")
        for r in rows:
            world = "-" if r["world_size"] is None else r["world_size"]
            ranks = ",".join(map(str, r["ranks"])) or "-"
            print(f"{r['step']:>10}  {r['state']:<14} {world:>5}  {ranks:<12} "
                  f"{r['bytes'] / 1e6:>8.1f}MB  {r['path']}")
    return 0


def _cmd_verify(args: argparse.Namespace) -> int:
    step, directory = _pick_step(args.dir, args.step)
    info = durable.commit_info(directory) or {}
    bad = 0
    for rank in info.get("ranks", []):
        try:
            durable.read_rank_shard(directory, rank)
            print(f"step {step} rank {rank}: ok")
        except CheckpointError as e:
            bad += 1
            print(f"step {step} rank {rank}: {e.reason}: {e}")
    print(f"step {step}: {'OK' if not bad else f'{bad} bad shard(s)'}")
    return 1 if bad else 0


def _cmd_export(args: argparse.Namespace) -> int:
    step, directory = _pick_step(args.dir, args.step)
    if not (directory / ".metadata").exists():
        raise _error(f"step {step} in {directory} holds only some ranks (a node-local copy); "
                     "export from the directory that holds every rank (the remote directory)")
    out: Path = args.out
    if out.exists():
        raise _error(f"{out} already exists; choose a new path")
    # DCP's reader checks no checksums: a damaged shard would be handed on as a good one.
    for rank in (durable.commit_info(directory) or {}).get("ranks", []):
        try:
            durable.read_rank_shard(directory, rank)
        except CheckpointError as e:
            raise _error(f"step {step} rank {rank} is {e.reason} ({e}); nothing exported. "
                         "Export an older step with --step (elasticft ckpt verify DIR --step N "
                         "checks one)") from None
    if args.format == "dcp":
        out.mkdir(parents=True, mode=0o700)
        for path in directory.iterdir():
            if path.name == ".metadata" or path.suffix == ".distcp":
                shutil.copy2(path, out / path.name)
    else:
        from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

        dcp_to_torch_save(str(directory), str(out))
    print(f"exported step {step} to {out} ({args.format})")
    return 0


def register(subparsers: argparse._SubParsersAction) -> None:
    ckpt = subparsers.add_parser("ckpt", help="list, verify and export durable checkpoints")
    commands = ckpt.add_subparsers(dest="ckpt_command", required=True, metavar="ACTION")
    ls = commands.add_parser("ls", help="list the checkpoints in a directory")
    ls.add_argument("dir", type=Path, help="checkpoint directory (holds step-* directories)")
    ls.add_argument("--json", action="store_true", help="machine-readable output")
    ls.set_defaults(handler=_cmd_ls)
    verify = commands.add_parser("verify", help="check every shard's checksums")
    verify.add_argument("dir", type=Path)
    verify.add_argument("--step", type=int, help="default: the newest committed step")
    verify.set_defaults(handler=_cmd_verify)
    export = commands.add_parser("export", help="write a plain DCP directory or torch.save file")
    export.add_argument("dir", type=Path)
    export.add_argument("--out", type=Path, required=True)
    export.add_argument("--step", type=int, help="default: the newest committed step")
    export.add_argument("--format", choices=("dcp", "torch"), default="dcp")
    export.set_defaults(handler=_cmd_export)
