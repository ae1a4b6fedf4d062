"""elasticft: a fault-tolerant drop-in for torchrun.

Launcher API (agent side)::

    from elasticft import launch, ElasticftConfig
    result = launch(torch_launch_config, "python", ["-u", "train.py"], ElasticftConfig())

Submodules are imported lazily so that ``import elasticft`` in a worker stays cheap.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

if TYPE_CHECKING:
    from elasticft.config import ElasticftConfig
    from elasticft.launcher import LaunchResult, launch
    from elasticft.plan.worker import layout
    from elasticft.worker import init

_LAZY = {
    "launch": ("elasticft.launcher", "launch"),
    "LaunchResult": ("elasticft.launcher", "LaunchResult"),
    "ElasticftConfig": ("elasticft.config", "ElasticftConfig"),
    "layout": ("elasticft.plan.worker", "layout"),
    "init": ("elasticft.worker", "init"),
}

__all__ = ["ElasticftConfig", "LaunchResult", "__version__", "init", "launch", "layout"]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        module, attr = _LAZY[name]
        return getattr(importlib.import_module(module), attr)
    raise AttributeError(f"module 'elasticft' has no attribute {name!r}")
