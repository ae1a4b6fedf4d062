"""Many worker processes from one interpreter that imported torch once.

A test that starts its own gloo ranks (not through a launcher) would import torch in every one
of them, about 2 s of CPU each. :func:`start_forked` starts one interpreter that imports the
given modules, then forks a child per rank; each child takes its environment and its
``sys.argv`` and runs the rank's script as ``python SCRIPT ARGS...`` or ``python -c CODE
ARGS...`` would. elasticft-run's warm template forks its workers the same way. The children are
real processes (their own pids, gloo connections, signals); what they share is the imports.
Nothing in the importing interpreter may start a thread before the fork: only imports run
there.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import textwrap
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

# argv[1]: JSON {"preload": [module, ...], "children": [{"env": {...}, "argv": [...]}, ...],
# "codes": a file or null}. Exits 0 once every child has exited 0; prints the children's exit
# statuses otherwise; writes them (JSON, as Popen.returncode gives them) to "codes" if given.
_FORKER = textwrap.dedent("""
    import importlib, json, os, runpy, sys, traceback
    spec = json.loads(sys.argv[1])
    for module in spec["preload"]:
        importlib.import_module(module)
    children = []
    for child in spec["children"]:
        pid = os.fork()
        if pid:
            children.append(pid)
            continue
        code = 1
        try:
            os.environ.clear()
            os.environ.update(child["env"])
            sys.argv = child["argv"]
            if sys.argv[0] == "-c":
                exec(compile(sys.argv.pop(1), "<string>", "exec"), {"__name__": "__main__"})
            else:
                sys.path[0] = os.path.dirname(os.path.abspath(sys.argv[0]))
                runpy.run_path(sys.argv[0], run_name="__main__")
            code = 0
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else int(e.code is not None)
        except BaseException:
            traceback.print_exc()
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
    codes = [os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) for pid in children]
    if spec["codes"]:
        with open(spec["codes"], "w") as out:
            json.dump(codes, out)
    if codes != [0] * len(codes):
        sys.exit(f"the forked children's exit statuses: {codes}")
""")


def start_forked(children: Sequence[tuple[Mapping[str, str], Sequence[str]]],
                 preload: Sequence[str], env: Mapping[str, str], cwd: Path,
                 codes: Path | None = None, **popen: Any) -> subprocess.Popen:
    """One process per ``(environment, argv)`` in ``children`` (argv as after ``python``:
    ``[SCRIPT, ARG...]`` or ``["-c", CODE, ARG...]``), forked from one interpreter (run with
    ``env`` in ``cwd``) that imported ``preload`` first. The returned process exits 0 once
    every child has exited 0, having written the children's exit statuses (a list, negative
    for a signal) to ``codes`` where given; the children are in its process group
    (:func:`killed`)."""
    spec = {"preload": list(preload), "codes": str(codes) if codes else None,
            "children": [{"env": dict(child_env), "argv": list(argv)}
                         for child_env, argv in children]}
    return subprocess.Popen([sys.executable, "-c", _FORKER, json.dumps(spec)], env=dict(env),
                            cwd=cwd, start_new_session=True, **popen)


def stop(job: subprocess.Popen) -> None:
    """SIGKILLs ``job`` (:func:`start_forked`) and its children if still there; waits for it."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(job.pid, signal.SIGKILL)
    job.wait()


@contextlib.contextmanager
def killed(job: subprocess.Popen) -> Iterator[subprocess.Popen]:
    """``job`` (:func:`start_forked`), stopped (:func:`stop`) on the way out."""
    try:
        yield job
    finally:
        stop(job)
