"""``elasticft-run`` with tuning constants set through the Python API, for tests.

Tuning constants (:func:`elasticft.config.tuning`) have no flag, variable or YAML key. A test
that needs one changed (two memory slots, a long heartbeat staleness on one node) starts this
script where it would start ``elasticft-run``::

    [*tuned_run({"diag_ring_dir": ring_base}), "--standalone", ..., "train.py"]

It passes the rest of its command line to :func:`elasticft.run.main` unchanged.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from elasticft import options as option_reading
from elasticft.config import ElasticftConfig


def tuned_run(tuning: Mapping[str, Any]) -> list[str]:
    """The command prefix that runs elasticft-run with these tuning constants (by field name)."""
    return [sys.executable, str(Path(__file__).resolve()),
            json.dumps({name: str(value) for name, value in tuning.items()}), "--"]


def apply_tuning(options: ElasticftConfig, tuning: Mapping[str, str]) -> ElasticftConfig:
    """``options`` with the named tuning constants set (values as text, converted by type)."""
    specs = {spec.name: spec for spec in option_reading.tuning_specs()}
    by_section: dict[str, dict[str, Any]] = {}
    for name, text in tuning.items():
        spec = specs[name]  # a KeyError names a field that is no tuning constant
        by_section.setdefault(spec.section, {})[name] = option_reading.convert(spec, text, name)
    return dataclasses.replace(options, **{
        section: dataclasses.replace(getattr(options, section), **fields)
        for section, fields in by_section.items()})


def main(argv: Sequence[str]) -> int:
    from elasticft import run

    tuning, separator, *rest = argv
    assert separator == "--", "usage: tuned_run.py JSON -- ELASTICFT-RUN-ARGS"
    return run.main(rest, tune=lambda options: apply_tuning(options, json.loads(tuning)))


if __name__ == "__main__":
    from elasticft import procs

    procs.skip_final_collection()  # as the elasticft-run console script does
    sys.exit(main(sys.argv[1:]))
