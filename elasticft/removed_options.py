"""Options that were removed or merged, and what became of each.

An old ``ELASTICFT_*`` variable or YAML key naming one is an error that says what replaced it
(:func:`removed_option_message`), instead of an unknown name or a silent no-op. The options
themselves are declared in :mod:`elasticft.config`.
"""

from __future__ import annotations

import dataclasses

from elasticft.config import ElasticftConfig, is_tuning

_API_ONLY = "now a tuning constant, settable only through the Python API"
REMOVED_OPTIONS: dict[str, str] = {
    "layout_tp": "replaced by --layout TP,PP,DP (* for a dimension left to the planner, "
                 "e.g. 2,*,*)",
    "layout_pp": "replaced by --layout TP,PP,DP (e.g. *,4,*)",
    "layout_dp": "replaced by --layout TP,PP,DP (e.g. *,*,8)",
    "ckpt_layout": "replaced by --layout TP,PP,DP: a fully given layout also places the peer "
                   "backups",
    "slurm_signal_lead_time": "replaced by --slurm-signal SIG@SECONDS (sbatch's syntax, e.g. "
                              "USR1@120)",
    "diag_preflight_allreduce": "replaced by --diag-preflight allreduce",
    "diag_metrics_port": "replaced by --diag-metrics [HOST:]PORT (e.g. 9100)",
    "diag_metrics_host": "replaced by --diag-metrics [HOST:]PORT (e.g. 0.0.0.0:9100)",
    "event_dir": "events are written under --run-dir, elsewhere only through the Python API "
                 "(AgentConfig.event_dir)",
    "capture_stderr": "the workers' stderr is captured, unless turned off through the Python "
                      "API (AgentConfig.capture_stderr)",
    "share_rdzv_store": "workers get a fresh store per attempt (the shared one breaks restarts, "
                        "pytorch#135712), unless the Python API asks for it "
                        "(AgentConfig.share_rdzv_store)",
    "plan_gpu_memory_gib": "give memory_gib in a --plan-hardware JSON file",
    "slurm_resubmit_script": "--slurm-requeue sbatch resubmits the job's own script",
    "ckpt_peer_addr": "derived from --local-addr, else this host's address",
    "ckpt_peer_secret": "a secret is generated per job",
}
"""Former option names (field names) and what became of each, for one-line errors on an old
``ELASTICFT_*`` variable or YAML key. Tuning constants not named here get a generic line."""


def removed_option_message(name: str) -> str | None:
    """What became of the former option ``name`` (a field name), or None if it never was one."""
    if name in REMOVED_OPTIONS:
        return REMOVED_OPTIONS[name]
    for section in dataclasses.fields(ElasticftConfig):
        cls = section.default_factory  # type: ignore[misc]
        for field in dataclasses.fields(cls):
            if field.name == name and is_tuning(field):
                return f"{_API_ONLY} ({cls.__name__}.{name})"
    return None
