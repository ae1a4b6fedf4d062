"""What the torchtitan integration decides without torchtitan: the key that turns it on, the
rules its trainer must keep, and the run's position as elasticft's memory holds it.

torchtitan swaps a component for another through its override mechanism: a config key lists
``module.function`` targets (``--override.imports`` on its command line, ``override.imports``
in a ``config_registry`` function), and torchtitan imports them before it builds any component.
:data:`ENABLE_TARGET` is the one target of elasticft's integration
(:mod:`elasticft.integrations.torchtitan`): it swaps the trainer's checkpoint manager for one
that also snapshots every step into elasticft's memory and that runs ``Trainer.train`` under
in-process recovery. :func:`enabled` reads whether a list of targets holds it.

:func:`trainer_problems` (pure, on :class:`TrainerFacts`) says what keeps a trainer from being
recovered in process, one line each; the integration raises the first as
:class:`~elasticft.integrations.fit.EntryRuleBroken` when recovery arms.

:func:`encode_position` and :func:`decode_position` carry torchtitan's own training position
(the trainer's step and token count, the learning-rate schedule, the data loader's state) in a
snapshot's extras, which hold JSON values: the data loader's state holds pickled bytes, so it
travels as base64 text.
"""

from __future__ import annotations

import base64
import dataclasses
import json
import pickle
from collections.abc import Iterable, Mapping
from typing import Any

ENABLE_TARGET = "elasticft.integrations.torchtitan.inprocess"
"""The ``override.imports`` target that turns in-process recovery on for torchtitan."""

SUPPORTED_CHECKPOINT = "CheckpointManager"
"""The checkpoint manager the integration extends: torchtitan's own (DCP)."""


def enabled(imports: Iterable[str | tuple[str, Mapping[str, Any]]]) -> bool:
    """Whether torchtitan's ``override.imports`` entries (a target, or a target with its
    arguments) turn in-process recovery on."""
    return any((entry if isinstance(entry, str) else entry[0]) == ENABLE_TARGET
               for entry in imports)


@dataclasses.dataclass(frozen=True)
class TrainerFacts:
    """What is true of torchtitan's trainer when recovery arms, just before ``train()``."""

    model_parts: int
    """Parts of the model this rank holds (more than one: pipeline parallel)."""
    optimizers: int
    """Optimizers in the trainer's ``OptimizersContainer``."""
    seed: int | None = 0
    """``debug.seed``: without one, torchtitan's trainer broadcasts rank 0's random seed on the
    default group while it is built, a collective a replacement would wait at alone."""
    checkpoint_manager: str = SUPPORTED_CHECKPOINT
    """The class name of the checkpoint manager the config asks for."""


def trainer_problems(facts: TrainerFacts) -> list[str]:
    """What breaks in-process recovery of torchtitan's trainer, one line each (pure)."""
    problems = []
    if facts.checkpoint_manager != SUPPORTED_CHECKPOINT:
        problems.append(f"in-process recovery of torchtitan extends its {SUPPORTED_CHECKPOINT}, "
                        f"not {facts.checkpoint_manager}: drop {ENABLE_TARGET} from "
                        "override.imports or use torchtitan's checkpoint manager")
    if facts.model_parts != 1:
        problems.append(f"in-process recovery of torchtitan keeps one model part, not "
                        f"{facts.model_parts}: drop {ENABLE_TARGET} from override.imports "
                        "under pipeline parallelism")
    elif facts.optimizers != 1:
        problems.append(f"in-process recovery of torchtitan restores one optimizer, not "
                        f"{facts.optimizers}")
    if facts.seed is None:
        problems.append("torchtitan broadcasts a random seed on the default group when "
                        "debug.seed is unset, a collective a replacement would wait at alone: "
                        "set debug.seed (--debug.seed N) for in-process recovery")
    return problems


def encode_position(train_state: Mapping[str, Any], lr_schedulers: Mapping[str, Any],
                    dataloader: Mapping[str, Any] | None) -> dict[str, str | None]:
    """torchtitan's training position as a snapshot's extras (strings: a snapshot keeps
    leaves, not empty containers)."""
    return {"train_state": json.dumps(dict(train_state)),
            "lr_schedulers": json.dumps(dict(lr_schedulers)),
            "dataloader": None if dataloader is None
            else base64.b64encode(pickle.dumps(dict(dataloader))).decode("ascii")}


def decode_position(extras: Mapping[str, Any]
                    ) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any] | None]:
    """The inverse of :func:`encode_position`: (train state, schedulers, data loader)."""
    dataloader = extras.get("dataloader")
    return (json.loads(extras["train_state"]), json.loads(extras["lr_schedulers"]),
            None if dataloader is None else pickle.loads(base64.b64decode(dataloader)))
