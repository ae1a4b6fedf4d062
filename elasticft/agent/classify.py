"""Failure classification under its earlier name: :mod:`elasticft.addon.classify` is where it
lives."""

from elasticft.addon.classify import FailureClass, FailureRecord

__all__ = ["FailureClass", "FailureRecord"]
