"""Optional dependencies: which extra of ``pip install elasticft[...]`` brings each one.

A feature that needs a package the user did not install stops with one line naming the extra
(:class:`MissingExtra`, exit code 2 in every entry point), never with a traceback of the import
that failed deep inside, and never by quietly doing less.

========================  ==================  ========================================
needed by                 package             extra
========================  ==================  ========================================
etcd-v3 rendezvous        grpcio, pyetcd      ``elasticft[etcd]``
``report --plot``         matplotlib          ``elasticft[report]``
hang stacks               py-spy (program)    ``elasticft[diag]``
GPU health (NVML)         nvidia-ml-py        ``elasticft[gpu]``
Lightning in process      lightning           ``elasticft[lightning]``
HF Trainer in process     transformers,       ``elasticft[hf]``
                          accelerate
torchtitan in process     torchtitan          ``elasticft[torchtitan]``
========================  ==================  ========================================

py-spy and nvidia-ml-py are also base dependencies, because the features that use them are on
by default: their checks catch an install made with ``--no-deps`` or a package removed later.
"""

from __future__ import annotations

import importlib
from types import ModuleType

ETCD = (("grpc", "grpcio"), ("pyetcd", "etcd-sdk-python"))
MATPLOTLIB = (("matplotlib", "matplotlib"),)
NVML = (("pynvml", "nvidia-ml-py"),)


class MissingExtra(ImportError):
    """A feature needs an optional package that is not installed; the message is one line."""

    reason = "missing_extra"

    def __init__(self, feature: str, package: str, extra: str, alternative: str = "") -> None:
        self.feature, self.package, self.extra = feature, package, extra
        message = f"{feature} needs {package}: pip install 'elasticft[{extra}]'"
        super().__init__(message + (f" ({alternative})" if alternative else ""))


def require(modules: tuple[tuple[str, str], ...], feature: str, extra: str,
            alternative: str = "") -> list[ModuleType]:
    """Imports ``(module, package)`` pairs; :class:`MissingExtra` for the first one missing."""
    loaded = []
    for module, package in modules:
        try:
            loaded.append(importlib.import_module(module))
        except ImportError:
            raise MissingExtra(feature, package, extra, alternative) from None
    return loaded


def require_etcd() -> None:
    require(ETCD, "the etcd-v3 rendezvous", "etcd")
