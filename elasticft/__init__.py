"""elasticft: a fault-tolerant drop-in for torchrun.

Launcher API (agent side)::

    from elasticft import launch, ElasticftConfig
    result = launch(torch_launch_config, "python", ["-u", "train.py"], ElasticftConfig())

Submodules are imported lazily so that ``import elasticft`` in a worker stays cheap.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from elasticft.lazy import lazy_getattr

__version__ = "0.1.0"

if TYPE_CHECKING:
    from elasticft.config import ElasticftConfig
    from elasticft.launcher import LaunchResult, launch
    from elasticft.plan.worker import layout
    from elasticft.worker import init

__all__ = ["ElasticftConfig", "LaunchResult", "__version__", "init", "launch", "layout"]

__getattr__ = lazy_getattr(__name__, {
    "launch": "elasticft.launcher",
    "LaunchResult": "elasticft.launcher",
    "ElasticftConfig": "elasticft.config",
    "layout": "elasticft.plan.worker",
    "init": "elasticft.worker",
})
