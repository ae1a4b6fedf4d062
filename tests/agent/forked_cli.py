"""Runs elasticft-run's entry point once per case, each in its own process forked from one
interpreter that has imported torch once: what the console script does (``sys.exit(main())``
with ``sys.argv`` set), with the case's own working directory, environment, stdout and stderr.

``python forked_cli.py CASES.json``: CASES is a list of ``{"argv", "env", "cwd", "stdout",
"stderr"}`` (the two streams are file paths); it writes each case's exit code, in order, to
``CASES.json.codes``. A usage error is answered before anything starts, so the cases cannot
disturb each other; forking them spares each a ~2 s torch import.
"""

from __future__ import annotations

import json
import os
import sys
import traceback
from pathlib import Path

import torch.distributed.run  # noqa: F401  (what every case's parser is built from)

from elasticft.run import main


def _exit_code(code: object) -> int:
    """The interpreter's exit status for ``sys.exit(code)``."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    print(code, file=sys.stderr)
    return 1


def _run_case(case: dict) -> int:
    pid = os.fork()
    if pid:
        _, status = os.waitpid(pid, 0)
        return os.waitstatus_to_exitcode(status)
    code = 1  # an exception out of main(): Python prints its traceback and exits 1
    try:
        os.chdir(case["cwd"])
        os.environ.clear()
        os.environ.update(case["env"])
        for fd, path in ((1, case["stdout"]), (2, case["stderr"])):
            target = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
            os.dup2(target, fd)
            os.close(target)
        sys.argv = ["elasticft-run", *case["argv"]]
        try:
            code = _exit_code(main())
        except SystemExit as e:
            code = _exit_code(e.code)
    except BaseException:
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


if __name__ == "__main__":
    cases_file = Path(sys.argv[1])
    codes = [_run_case(case) for case in json.loads(cases_file.read_text())]
    Path(f"{cases_file}.codes").write_text(json.dumps(codes))
