"""The environment a bench gives the jobs it launches: this process's, without any variable that
would steer elasticft or torchrun (``ELASTICFT_*``, ``PET_*``, ``TORCHELASTIC_*``), one thread per
worker for OpenMP, and unbuffered output so that a killed job's last lines are kept."""

from __future__ import annotations

import os


def clean_job_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("ELASTICFT_", "PET_", "TORCHELASTIC_"))}
    env.update(PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
    return env
