"""The worker's view of the layout: ``elasticft.layout()``.

The agents publish the round's layout to every worker as environment variables
(``ELASTICFT_TP``, ``ELASTICFT_PP``, ``ELASTICFT_DP``, ``ELASTICFT_GRAD_ACCUM``). A training
script builds its device mesh from it, e.g.::

    layout = elasticft.layout()
    mesh = init_device_mesh("cuda", layout.mesh_shape, mesh_dim_names=("pp", "dp", "tp"))

Ranks from ``layout.gpus_used`` on are idle in this round (``layout.coords(rank)`` is None).
Without those variables (plain torchrun, or no planner configured) the layout is pure data
parallelism over ``WORLD_SIZE`` ranks with no accumulation.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from elasticft.plan.api import Layout, PlanError

LAYOUT_ENV = {
    "tp": "ELASTICFT_TP",
    "pp": "ELASTICFT_PP",
    "dp": "ELASTICFT_DP",
    "grad_accum": "ELASTICFT_GRAD_ACCUM",
}
WORKER_ENV = frozenset(LAYOUT_ENV.values())
"""Worker variables of the layout (listed in the agent's WORKER_ENV_NAMES)."""


def layout_env(layout: Layout) -> dict[str, str]:
    """The worker environment that carries a layout."""
    return {env: str(getattr(layout, field)) for field, env in LAYOUT_ENV.items()}


def layout(env: Mapping[str, str] | None = None) -> Layout:
    """This round's layout, from the worker environment (``os.environ`` by default)."""
    env = os.environ if env is None else env
    if LAYOUT_ENV["tp"] not in env:
        return Layout(tp=1, pp=1, dp=int(env.get("WORLD_SIZE", "1")), grad_accum=1)
    values = {}
    for field, name in LAYOUT_ENV.items():
        raw = env.get(name, "")
        try:
            values[field] = int(raw)
        except ValueError:
            raise PlanError(f"{name}={raw!r} is not a whole number; the agent sets it") from None
    return Layout(**values)
