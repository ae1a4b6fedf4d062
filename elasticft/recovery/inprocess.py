"""Moved to :mod:`elasticft.inprocess.worker`: its names import from here too."""

from elasticft.lazy import moved_getattr

__getattr__ = moved_getattr(__name__, "elasticft.inprocess.worker",
                            {"InProcess", "LEAVE_EXIT_CODE", "RecoveryTimeout", "peer_failure",
                             "run"})
