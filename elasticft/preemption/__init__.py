"""Preemption: a machine's announced end becomes a checkpoint and a clean "resume me" exit.

* :mod:`~elasticft.preemption.notices`: where announcements come from (cloud metadata
  endpoints, Kubernetes' SIGTERM), each provider's answer parsed by a pure function into one
  :class:`~elasticft.preemption.notices.Notice`.
* :mod:`~elasticft.preemption.decision`: what a notice does, a pure decision with its reason.
* :mod:`~elasticft.preemption.handler`: the agent's add-on that watches, decides and acts
  through the one "save before the deadline" path (:mod:`elasticft.addon.savenow`).
"""

PREEMPTED_EXIT_CODE = 75
"""The launcher's exit code after a preemption: sysexits' EX_TEMPFAIL, "a temporary failure,
try again". Distinct from a failure (1), bad input (2) and a signal (128+N): a scheduler or an
operator relaunches the same command, which resumes from the persisted step."""
