"""The recovery policy under its earlier name: :mod:`elasticft.addon.policy` is where it
lives."""

from elasticft.addon.policy import Action, ActionKind, FailureFacts, decide

__all__ = ["Action", "ActionKind", "FailureFacts", "decide"]
