"""The reliability report: what a run's failures cost, from its event log and step records.

``elasticft report RUN_DIR`` (:mod:`elasticft.report.cli`) reads the agent's events
(:mod:`elasticft.events`) and the workers' step records (:mod:`elasticft.steps`), splits the
run's wall time into the phases of the Training Overhead Ratio model (:mod:`elasticft.report.tor`),
and prints TOR, ETTR, MTBF and a per-fault breakdown; ``--plot`` draws the timeline
(:mod:`elasticft.report.plot`). ``--what-if`` predicts TOR and the best checkpoint interval from
the model's equations (:mod:`elasticft.report.whatif`). ``elasticft status``
(:mod:`elasticft.report.status`) shows where a running job stands: its rendezvous membership and
the newest detections in its event log.
"""
