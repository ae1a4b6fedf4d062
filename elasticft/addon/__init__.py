"""The add-on interface: how a subsystem joins the node agent, and what it decides with.

A subsystem (checkpoints, diagnostics, recovery, the layout plan, Slurm) joins the agent as an
add-on (:class:`~elasticft.addon.api.AddOn`) whose collaborator overrides the hooks it needs
(:class:`~elasticft.addon.api.AgentCollaborator`). The facts the hooks pass are here too: the
worker group, a failure's class (:mod:`~elasticft.addon.classify`) and the pure policy that turns
a failure's facts into one action (:mod:`~elasticft.addon.policy`).

This package sits below every add-on and imports none of them; the agent that runs the add-ons
(:mod:`elasticft.agent`) sits above them.
"""
