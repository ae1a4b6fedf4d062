"""The add-on interface under its earlier name: :mod:`elasticft.addon.api` is where it lives.

Code written against ``elasticft.agent.api`` (a collaborator of its own, an add-on) keeps
working; new code imports from :mod:`elasticft.addon.api`.
"""

from elasticft.addon.api import (
    AddOn,
    AddOnContext,
    AgentCollaborator,
    Detection,
    GroupInfo,
    StopRun,
    WorkerInfo,
    run_ending_errors,
)

__all__ = ["AddOn", "AddOnContext", "AgentCollaborator", "Detection", "GroupInfo", "StopRun",
           "WorkerInfo", "run_ending_errors"]
