"""Moved to :mod:`elasticft.inprocess.interrupt`: its names import from here too."""

from elasticft.lazy import moved_getattr

__getattr__ = moved_getattr(__name__, "elasticft.inprocess.interrupt",
                            {"Monitor", "PeerInterrupted"})
