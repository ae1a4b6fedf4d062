"""Runs elasticft-run's entry point once per case, each in its own process forked from one
interpreter that has imported torch once: what the console script does (``sys.exit(main())``
with ``sys.argv`` set), with the case's own working directory, environment, stdout and stderr.

``python -m tests.agent.forked_cli CASES.json`` (from the checkout's root): CASES is a list of
``{"argv", "env", "cwd", "stdout", "stderr"}`` (the two streams are file paths); it writes each
case's exit code, in order, to ``CASES.json.codes``. A usage error is answered before anything
starts, so the cases cannot disturb each other; forking them spares each a ~2 s torch import.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch.distributed.run  # noqa: F401  (what every case's parser is built from)

from elasticft.run import main
from tests.forked import exit_as_python


def _run_case(case: dict) -> int:
    pid = os.fork()
    if not pid:
        sys.argv = ["elasticft-run", *case["argv"]]
        exit_as_python(lambda: sys.exit(main()), env=case["env"], cwd=case["cwd"],
                       stdout=case["stdout"], stderr=case["stderr"])
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status)


if __name__ == "__main__":
    cases_file = Path(sys.argv[1])
    codes = [_run_case(case) for case in json.loads(cases_file.read_text())]
    Path(f"{cases_file}.codes").write_text(json.dumps(codes))
