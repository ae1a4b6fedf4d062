"""What a worker's checkpointer needs to know, read from the environment in one place.

Under ``elasticft-run`` the agent's checkpoint service hands every worker its shared-memory slots,
directories, backup peer and control directory through ``ELASTICFT_WORKER_CKPT_*`` variables
(:data:`WORKER_ENV`; no option's variable begins with ``ELASTICFT_WORKER_``). Without an agent
(plain ``torchrun`` or one process) the worker owns its memory tier and persists it itself; the same
settings are then given to :meth:`WorkerSettings.from_env` as arguments. A local directory the
script gives explicitly (``ckpt_dir=``) is the job's under both: the worker announces it to the
agent, which persists there (:func:`elasticft.ckpt.control.announce_dir`).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from pathlib import Path

from elasticft.ckpt.memory import shm

ENV_SHM = "ELASTICFT_WORKER_CKPT_SHM"
ENV_SLOTS = "ELASTICFT_WORKER_CKPT_SLOTS"
ENV_MEMORY_CAP = "ELASTICFT_WORKER_CKPT_MEMORY_CAP"
ENV_LOCAL = "ELASTICFT_WORKER_CKPT_LOCAL"
ENV_REMOTE = "ELASTICFT_WORKER_CKPT_REMOTE"
ENV_PEER = "ELASTICFT_WORKER_CKPT_PEER"
ENV_REPLICA_PEER = "ELASTICFT_WORKER_CKPT_REPLICA_PEER"
ENV_NODE_PEER = "ELASTICFT_WORKER_CKPT_NODE_PEER"
ENV_SECRET = "ELASTICFT_WORKER_CKPT_SECRET"
ENV_CONTROL = "ELASTICFT_WORKER_CKPT_CONTROL"
ENV_GPU_STAGING = "ELASTICFT_WORKER_CKPT_GPU_STAGING"
ENV_NODE_DIR = "ELASTICFT_WORKER_CKPT_NODE_DIR"
"""The subdirectory of the local checkpoint directory that holds this node's shards (a
multi-node job: ``node-<node id>``); unset for a single node."""
ENV_FRESH = "ELASTICFT_WORKER_CKPT_FRESH"
"""Set by ``--fresh``: this launch's token; see
:func:`elasticft.ckpt.persisting.durable.start_fresh`."""
ENV_RESTORE_AT_MOST = "ELASTICFT_WORKER_CKPT_RESTORE_AT_MOST"
"""The newest step a restore may take: set after silent data corruption was found, to the
newest step at which every fingerprint agreed (:mod:`elasticft.ckpt.integrity.sdcwatch`)."""

WORKER_ENV = frozenset(
    {ENV_SHM, ENV_SLOTS, ENV_MEMORY_CAP, ENV_LOCAL, ENV_REMOTE, ENV_PEER, ENV_REPLICA_PEER,
     ENV_NODE_PEER, ENV_SECRET, ENV_CONTROL, ENV_GPU_STAGING, ENV_NODE_DIR, ENV_FRESH,
     ENV_RESTORE_AT_MOST}
)
"""Worker variables the checkpoint service sets (listed in the agent's WORKER_ENV_NAMES)."""


@dataclasses.dataclass(frozen=True)
class WorkerSettings:
    """One worker's view of the checkpoint tiers."""

    local_rank: int = 0
    shm_slots: str | None = None
    """Where this rank's shared-memory slots are (see :func:`elasticft.ckpt.memory.shm.slot_paths`):
    the agent's unnamed files, or a name prefix when the process owns them; None disables the
    memory tier."""
    slots: int = 3
    """Newest complete snapshot, one being read (persisted, flushed), one being written."""
    memory_cap_bytes: int = 0
    """Most bytes this rank's slots may take together (0: no cap)."""
    local_dir: Path | None = None
    """Where this rank's shards persist and are restored from (this node's part of it)."""
    chosen_dir: Path | None = None
    """The local directory the script gave (``ckpt_dir=``), absolute: under an agent the worker
    announces it, and the agent persists there instead of its own."""
    fresh_launch: str | None = None
    """``--fresh``: this launch's token; the checkpoints earlier launches left in
    ``local_dir`` are removed before anything is restored."""
    remote_dir: Path | None = None
    peer_addr: str | None = None
    """host:port of the agent holding this node's backup."""
    replica_peer_addr: str | None = None
    """host:port of an agent holding a data-parallel replica of this node's ranks, when that is
    not the backup node (a (tp, pp, dp) layout); asked before the backup node."""
    node_peer_addr: str | None = None
    """host:port of this node's own agent: after a new round gave this worker another rank,
    the agent's memory still holds a replica of it taken under the old rank."""
    secret: str | None = None
    control_dir: Path | None = None
    agent_owned: bool = False
    """True under elasticft-run: the agent persists, replicates and removes the memory tier."""
    persist_every: int = 0
    """Process-owned mode: persist every N saves' steps to the durable tiers (0: never)."""
    keep: int = 3
    owner_pid: int = 0
    gpu_staging_bytes: int = 0
    """Most device memory a CUDA snapshot may be staged in before its copy to the host (0: no
    staging; see :mod:`elasticft.ckpt.memory.device`)."""
    restore_at_most: int | None = None
    """The newest step a restore may take (None: any); see :data:`ENV_RESTORE_AT_MOST`."""

    @classmethod
    def from_env(
        cls,
        env: Mapping[str, str] | None = None,
        *,
        ckpt_dir: str | os.PathLike[str] | None = None,
        remote_dir: str | os.PathLike[str] | None = None,
        persist_every: int = 0,
        keep: int = 3,
        slots: int = 3,
        memory: bool = True,
        gpu_staging_bytes: int = 0,
    ) -> WorkerSettings:
        """Agent-owned settings when the agent set them, else a process-owned memory tier.

        The keyword arguments are the process-owned defaults; the agent's values win, except
        ``ckpt_dir``: the directory the script chose is where the agent persists too.
        """
        env = os.environ if env is None else env
        local_rank = int(env.get("LOCAL_RANK", "0"))
        if ENV_SHM in env:
            chosen = Path(ckpt_dir).absolute() if ckpt_dir is not None else None
            local = Path(env[ENV_LOCAL]) if env.get(ENV_LOCAL) else None
            if chosen is not None:
                local = chosen / env[ENV_NODE_DIR] if env.get(ENV_NODE_DIR) else chosen
            return cls(
                local_rank=local_rank,
                shm_slots=env[ENV_SHM] or None,
                slots=int(env.get(ENV_SLOTS, "3")),
                memory_cap_bytes=int(env.get(ENV_MEMORY_CAP, "0")),
                local_dir=local,
                chosen_dir=chosen,
                fresh_launch=env.get(ENV_FRESH) or None,
                remote_dir=Path(env[ENV_REMOTE]) if env.get(ENV_REMOTE) else None,
                peer_addr=env.get(ENV_PEER) or None,
                replica_peer_addr=env.get(ENV_REPLICA_PEER) or None,
                node_peer_addr=env.get(ENV_NODE_PEER) or None,
                secret=env.get(ENV_SECRET) or None,
                control_dir=Path(env[ENV_CONTROL]) if env.get(ENV_CONTROL) else None,
                agent_owned=True,
                keep=keep,
                gpu_staging_bytes=int(env.get(ENV_GPU_STAGING, "0")),
                restore_at_most=(int(env[ENV_RESTORE_AT_MOST])
                                 if env.get(ENV_RESTORE_AT_MOST) else None),
            )
        # Under torchrun the parent is torch's agent: segments named after it survive a worker
        # restart and are swept once that agent is gone. Alone, the process owns them.
        run_id = env.get("TORCHELASTIC_RUN_ID")
        owner = os.getppid() if run_id else os.getpid()
        prefix = shm.segment_prefix(owner, run_id or "solo", local_rank) if memory else None
        return cls(
            local_rank=local_rank,
            shm_slots=prefix,
            slots=slots,
            local_dir=Path(ckpt_dir) if ckpt_dir is not None else None,
            remote_dir=Path(remote_dir) if remote_dir is not None else None,
            persist_every=persist_every,
            keep=keep,
            owner_pid=owner,
            gpu_staging_bytes=gpu_staging_bytes,
        )
