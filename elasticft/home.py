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
   same script (its real path), module or program, with the same arguments, the same
   ``--nnodes`` and ``--nproc-per-node``, from the same directory. Two launches that differ
   in any of these are two jobs, so a sweep of learning rates never resumes another's
   checkpoints; the launcher's other flags (ports, restarts, elasticft's options) do not
   count. The id reads ``<script name>-<10 hex digits>``.

A multi-node launch without an id keeps torchrun's (``none``): every node must agree on it,
and a derived one would differ between nodes whose command lines differ (``--node-rank``).

The rendezvous itself is unaffected: a single-node launch hosts a fresh store on a port of its
own, whatever its id.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
from collections.abc import Sequence
from typing import Literal

EntryKind = Literal["script", "module", "program"]

UNGIVEN_IDS = ("", "none")
"""Values of ``--rdzv-id`` that mean none was given (torchrun's default is ``none``)."""


def derived_run_id(entry: str, kind: EntryKind, script_args: Sequence[str], nnodes: str,
                   nproc_per_node: str, cwd: str) -> str:
    """The run id of a single-node launch given no id: the same inputs give the same id.

    Pure: ``entry`` is already resolved (a script's real path, a module's name, a program's
    path), ``cwd`` the real path of the working directory.
    """
    identity = json.dumps([kind, entry, list(script_args), str(nnodes), str(nproc_per_node),
                           cwd])
    digest = hashlib.blake2b(identity.encode(), digest_size=5).hexdigest()
    name = os.path.basename(entry) if kind != "module" else entry
    if kind == "script":
        name = os.path.splitext(name)[0]
    stem = re.sub(r"[^A-Za-z0-9_.-]", "_", name).strip("._-")[:40] or "job"
    return f"{stem}-{digest}"


def launched_run_id(training_script: str, module: bool, no_python: bool,
                    script_args: Sequence[str], nnodes: str, nproc_per_node: str) -> str:
    """:func:`derived_run_id` of what this process was asked to launch, from this directory."""
    kind: EntryKind = "program" if no_python else "module" if module else "script"
    if kind == "script":
        entry = os.path.realpath(training_script)
    elif kind == "program":
        entry = shutil.which(training_script) or os.path.realpath(training_script)
    else:
        entry = training_script
    return derived_run_id(entry, kind, script_args, nnodes, nproc_per_node,
                          os.path.realpath(os.getcwd()))
