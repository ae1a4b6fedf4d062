"""The ``torchrun.handlers`` entry point of the ``etcd-v3`` rendezvous.

torch loads every entry point of the group while its rendezvous package is being imported, and
elasticft's rendezvous modules import that package themselves; so this module imports nothing of
elasticft, and the creator imports the handler only when a handler is asked for.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


def handler_factory() -> Callable[[Any], Any]:
    """Zero-argument factory returning the creator ``RendezvousParameters -> handler``."""

    def create_etcd_v3_handler(params: Any) -> Any:
        from elasticft.rendezvous.handler import create_handler

        return create_handler(params)

    return create_etcd_v3_handler
