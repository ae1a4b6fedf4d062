"""Where a node's checkpoints and its channel to its workers live.

* **The job's directory.** Checkpoints persist in the directory the script chose
  (``Checkpointer.from_env(ckpt_dir=...)``, announced by its workers before their first save),
  else ``--ckpt-dir``, else ``<run-dir>/ckpt``. A relaunch restores from there.
* **The node's part of it.** A single node's shards form a complete DCP checkpoint in that
  directory; in a multi-node job each node keeps its own shards on its own disk, in
  ``node-<node id>`` below it.
* **The control directory**, ``<run-dir>/ckpt-control/<agent pid>``: the files through which
  the agent and its workers talk (:mod:`elasticft.ckpt.control`), one per agent of the run.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

from elasticft.addon.api import GroupInfo
from elasticft.ckpt.control import announced_dirs
from elasticft.config import checkpoint_dir_default

logger = logging.getLogger(__name__)


class NodePlaces:
    """The directories of one agent's checkpoints, as of its latest worker group."""

    def __init__(self, ckpt_dir: Path | None) -> None:
        self.ckpt_dir = ckpt_dir
        """``--ckpt-dir`` (None: ``<run-dir>/ckpt``)."""
        self._owner = os.getpid()
        self._chosen: Path | None = None

    def default_root(self, group: GroupInfo) -> Path:
        """``--ckpt-dir``, else ``<run-dir>/ckpt``: where the script's choice is not known."""
        return checkpoint_dir_default(self.ckpt_dir, group.run_dir)

    def local_root(self, group: GroupInfo) -> Path:
        """The job's local checkpoint directory: the one the script chose, else --ckpt-dir,
        else ``<run-dir>/ckpt``."""
        try:
            chosen = announced_dirs(self.control_dir(group), (w.local_rank for w in group.workers))
        except OSError:
            chosen = {}
        if chosen:
            directory = chosen[min(chosen)]
            if directory != self._chosen:
                self._chosen = directory
                instead = self.default_root(group)
                logger.info("checkpoints persist in %s, the directory the script chose%s",
                            directory, "" if directory == instead.absolute()
                            else f" (not {instead})")
                if len(set(chosen.values())) > 1:
                    logger.warning("the local ranks chose different checkpoint directories "
                                   "(%s); local rank %d's is used", sorted(map(str, set(
                                       chosen.values()))), min(chosen))
        return self._chosen or self.default_root(group)

    def local_dir(self, group: GroupInfo) -> Path:
        """This node's shards: the job's directory itself on a single node."""
        return self.local_root(group) / self.node_dir(group)

    @staticmethod
    def node_dir(group: GroupInfo) -> str:
        """This node's part of the job's directory (empty on a single node)."""
        return "" if group.group_world_size <= 1 else f"node-{group.node_id}"

    def control_dir(self, group: GroupInfo) -> Path:
        return group.run_dir / "ckpt-control" / str(self._owner)
