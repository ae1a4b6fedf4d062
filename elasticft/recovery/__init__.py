"""Hierarchical recovery: just-in-time checkpoints, eviction and blacklisting (see
:mod:`elasticft.recovery.orchestrator`)."""
