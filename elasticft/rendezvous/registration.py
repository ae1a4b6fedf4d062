"""The ``torchrun.handlers`` entry point of the ``etcd-v3`` rendezvous.

torch loads every entry point of the group while its rendezvous package is being imported, and
elasticft's rendezvous modules import that package themselves; so this module imports nothing of
elasticft, and the creator imports the handler only when a handler is asked for.

Without the etcd extra, plain ``torchrun --rdzv-backend etcd-v3`` stops with one line naming it
and exit code 2, not with the traceback of a failed ``import grpc``.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from typing import Any


def handler_factory() -> Callable[[Any], Any]:
    """Zero-argument factory returning the creator ``RendezvousParameters -> handler``."""

    def create_etcd_v3_handler(params: Any) -> Any:
        from elasticft.extras import MissingExtra

        try:
            from elasticft.rendezvous.factory import create_handler

            return create_handler(params)
        except MissingExtra as e:
            print(f"{os.path.basename(sys.argv[0]) or 'torchrun'}: error: {e}", file=sys.stderr)
            raise SystemExit(2) from None

    return create_etcd_v3_handler
