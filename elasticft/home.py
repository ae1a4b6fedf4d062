"""A job's home: what makes two launches the same job, and so where its files and checkpoints go.

A relaunch of a job (by hand, by a scheduler without Slurm's job id, by a Kubernetes operator)
must find what the previous launch saved. Everything a run writes lives under its *run
directory* (``./elasticft-runs/<run id>`` unless ``--run-dir`` or ``--log-dir`` says otherwise),
its checkpoints in ``<run-dir>/ckpt``, so what matters is that a relaunch gets the same run id.

torchrun gives every single-node launch (``--standalone``, or one static node) a random
rendezvous id: right for a rendezvous, which must not meet a previous launch's store, wrong for
a home, which then changes at every launch and leaves the previous one's checkpoints behind.
elasticft's run id is instead, in this order:

1. the id the user gave: ``--rdzv-id`` or ``PET_RDZV_ID`` (also under ``--standalone``, where
   torchrun ignores it);
2. under Slurm, ``slurm-<job id>`` (:func:`elasticft.slurm.run_id_default`), the same across
   requeues;
3. for a single-node launch, one derived from what was launched (:func:`derived_run_id`): the
   same script (its real path), module or program, the same ``--nnodes`` and
   ``--nproc-per-node``, from the same directory. The script's arguments do not count: the
   most common relaunch is the same job told to train longer (``--steps 30`` after
   ``--steps 20``), which must resume, as it would from a checkpoint folder the script names
   itself. The launcher logs which arguments changed since the previous launch
   (:func:`relaunch_line`); a change that makes the checkpoint unusable (another model size)
   stops the run at once, naming ``--fresh``. Runs that must stay apart (a sweep of
   learning rates) are given ids of their own with ``--rdzv-id`` or ``--run-dir``. The
   launcher's other flags (ports, restarts, elasticft's options) do not count either. The id
   reads ``<script name>-<10 hex digits>``.

A multi-node launch without an id keeps torchrun's (``none``): every node must agree on it,
and a derived one would differ between nodes whose command lines differ (``--node-rank``).

The rendezvous itself is unaffected: a single-node launch hosts a fresh store on a port of its
own, whatever its id.

A new run never starts silently from step 0 beside a checkpoint of the same script: when a run
directory next to its own holds one (another number of workers, another ``--rdzv-id``), the
launcher warns and names the ``--run-dir`` that continues it (:func:`same_script_elsewhere`).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal

EntryKind = Literal["script", "module", "program"]

UNGIVEN_IDS = ("", "none")
"""Values of ``--rdzv-id`` that mean none was given (torchrun's default is ``none``)."""


def derived_run_id(entry: str, kind: EntryKind, nnodes: str, nproc_per_node: str,
                   cwd: str) -> str:
    """The run id of a single-node launch given no id: the same inputs give the same id.

    Pure: ``entry`` is already resolved (a script's real path, a module's name, a program's
    path), ``cwd`` the real path of the working directory.
    """
    identity = json.dumps([kind, entry, str(nnodes), str(nproc_per_node), cwd])
    digest = hashlib.blake2b(identity.encode(), digest_size=5).hexdigest()
    name = os.path.basename(entry) if kind != "module" else entry
    if kind == "script":
        name = os.path.splitext(name)[0]
    stem = re.sub(r"[^A-Za-z0-9_.-]", "_", name).strip("._-")[:40] or "job"
    return f"{stem}-{digest}"


def launched_run_id(training_script: str, module: bool, no_python: bool, nnodes: str,
                    nproc_per_node: str) -> str:
    """:func:`derived_run_id` of what this process was asked to launch, from this directory."""
    kind: EntryKind = "program" if no_python else "module" if module else "script"
    if kind == "script":
        entry = os.path.realpath(training_script)
    elif kind == "program":
        entry = shutil.which(training_script) or os.path.realpath(training_script)
    else:
        entry = training_script
    return derived_run_id(entry, kind, nnodes, nproc_per_node, os.path.realpath(os.getcwd()))


# ----------------------------------------------------------------------------------------------
# A relaunch: what the previous launch of the job was given, and what changed since.


def script_arguments(args: Sequence[str]) -> list[str]:
    """The script's own arguments in a launch's command arguments (pure): what follows
    ``-u script.py`` or ``-u -m module`` (torch's form), else the arguments as they are."""
    rest = list(args)
    if rest[:1] == ["-u"]:
        rest = rest[1:]
        return rest[2:] if rest[:1] == ["-m"] else rest[1:]
    return rest


def _is_flag(token: str) -> bool:
    if not token.startswith("-") or token == "-":
        return False
    try:
        float(token)
    except ValueError:
        return True
    return False  # a negative number is a value


def _by_name(args: Sequence[str]) -> dict[str, str | None]:
    """``--name value``, ``--name=value`` and bare ``--flag`` by name; positional arguments as
    ``argument N``."""
    named: dict[str, str | None] = {}
    position = 0
    i = 0
    while i < len(args):
        token = args[i]
        if _is_flag(token):
            name, equals, value = token.partition("=")
            if equals:
                named[name] = value
            elif i + 1 < len(args) and not _is_flag(args[i + 1]):
                named[name] = args[i + 1]
                i += 1
            else:
                named[name] = None
        else:
            position += 1
            named[f"argument {position}"] = token
        i += 1
    return named


def changed_arguments(before: Sequence[str], after: Sequence[str]) -> list[str]:
    """What changed between two launches' script arguments, one phrase per argument (pure):
    ``--steps 20 -> 30``, ``--lr 0.1 added``, ``--fsdp2 removed``; empty when nothing did."""
    old, new = _by_name(before), _by_name(after)

    def shown(name: str, value: str | None) -> str:
        return name if value is None else f"{name} {value}"

    changes = []
    for name in [*old, *(n for n in new if n not in old)]:
        if name not in new:
            changes.append(f"{shown(name, old[name])} removed")
        elif name not in old:
            changes.append(f"{shown(name, new[name])} added")
        elif old[name] != new[name]:
            changes.append(f"{name} {old[name] or '(flag)'} -> {new[name] or '(flag)'}")
    if not changes and list(before) != list(after):
        changes.append("the same arguments, reordered or repeated")
    return changes


def previous_launch(run_dir: Path) -> dict[str, Any] | None:
    """The newest ``run_start`` event in ``run_dir`` (a previous launch's record: its run id,
    entrypoint and arguments), or None for a new run directory."""
    from elasticft.events import read_events

    if not run_dir.is_dir():
        return None
    starts = [e for e in read_events(run_dir) if e.get("kind") == "run_start"]
    return starts[-1] if starts else None


def newest_checkpoint(ckpt_dir: Path) -> int | None:
    """The newest committed step in a local checkpoint directory (or its nodes'
    subdirectories), or None."""
    from elasticft.ckpt.persisting.durable import committed_steps

    steps = set(committed_steps(ckpt_dir))
    if ckpt_dir.is_dir():
        for node in ckpt_dir.glob("node-*"):
            steps |= set(committed_steps(node))
    return max(steps, default=None)


def relaunch_line(run_id: str, previous_args: Sequence[str], args: Sequence[str],
                  step: int | None, ckpt_dir: Path, fresh: bool = False,
                  scripts: tuple[str | None, str | None] = (None, None)) -> str:
    """The launcher's line about a relaunch (pure): which run it continues, from which step,
    and which arguments changed. ``scripts``: the previous launch's script and this one's
    (real paths; None where unknown)."""
    changes = changed_arguments(script_arguments(previous_args), script_arguments(args))
    changed = (f"script arguments changed since the last launch: {', '.join(changes)}"
               if changes else "the same script arguments as the last launch")
    before, now = scripts
    if before is not None and now is not None and before != now:
        changed = f"another script than the last launch ({before} -> {now}); {changed}"
    if fresh:
        return (f"relaunch of run {run_id} with --fresh: starts from step 0 (the checkpoints of "
                f"earlier launches are removed); {changed}")
    where = (f"resumes from its newest checkpoint, step {step} in {ckpt_dir}" if step is not None
             else f"no committed checkpoint in {ckpt_dir} (one the script keeps elsewhere is "
                  "restored from there)")
    return f"relaunch of run {run_id}: {where}; {changed}; --fresh starts over"


def script_path(args: Sequence[str]) -> str | None:
    """The real path of the script in a launch's command arguments (``-u script.py ...``), or
    None for a module or a program."""
    if len(args) > 1 and args[0] == "-u" and args[1] != "-m":
        return os.path.realpath(args[1])
    return None


def _first_run_start(run_dir: Path) -> dict[str, Any] | None:
    """The ``run_start`` event of one of ``run_dir``'s event logs (among its first lines)."""
    from elasticft.events import EVENT_FILE_GLOB

    for path in sorted(run_dir.glob(EVENT_FILE_GLOB)):
        try:
            with open(path) as f:
                for _, line in zip(range(50), f, strict=False):
                    try:
                        event = json.loads(line)
                    except ValueError:
                        continue
                    if event.get("kind") == "run_start":
                        return dict(event)
        except OSError:
            continue
    return None


def same_script_elsewhere(run_dir: Path, script: str) -> list[tuple[Path, dict[str, Any], int]]:
    """Other run directories beside ``run_dir`` whose job ran the same script (another number
    of workers, another --rdzv-id) and left a committed checkpoint in their ``ckpt``: each
    with its ``run_start`` event and its newest step."""
    found = []
    parent = run_dir.absolute().parent
    try:
        siblings = sorted(p for p in parent.iterdir() if p.is_dir())
    except OSError:
        return []
    for other in siblings:
        if other == run_dir.absolute():
            continue
        start = _first_run_start(other)
        if start is None or start.get("script") != script:
            continue
        step = newest_checkpoint(other / "ckpt")
        if step is not None:
            found.append((other, start, step))
    return found


def elsewhere_line(run_id: str, other: Path, start: dict[str, Any], step: int,
                   nnodes: str, nproc_per_node: int) -> str:
    """The launcher's warning for a new run whose script has a checkpoint in another run's
    directory beside it (pure)."""
    before = (f"--nnodes {start.get('min_nodes')}:{start.get('max_nodes')} --nproc-per-node "
              f"{start.get('nproc_per_node')}")
    return (f"run {run_id} starts from step 0, but the same script has a checkpoint (step "
            f"{step}) in {other}, run {start.get('run_id')} ({before}; this launch: --nnodes "
            f"{nnodes} --nproc-per-node {nproc_per_node}): another job. To continue that one, "
            f"give --run-dir {other} (its checkpoint is resharded to this number of workers)")
