"""Many worker processes from one interpreter that imported torch once.

A test that starts its own gloo ranks (not through a launcher) would import torch in every one
of them, about 2 s of CPU each. :func:`start_forked` starts one interpreter that imports the
given modules, then forks a child per rank; each child takes its environment and its
``sys.argv`` and runs the rank's script as ``python SCRIPT ARGS...`` or ``python -c CODE
ARGS...`` would. elasticft-run's warm template forks its workers the same way. The children are
real processes (their own pids, gloo connections, signals); what they share is the imports.
Nothing in the importing interpreter may start a thread before the fork: only imports run
there. Other forking helpers end their children with :func:`exit_as_python` too.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import runpy
import signal
import subprocess
import sys
import traceback
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, NoReturn

ROOT = Path(__file__).resolve().parent.parent


def exit_as_python(run: Callable[[], object], env: Mapping[str, str] | None = None,
                   cwd: str | None = None, stdout: str | None = None,
                   stderr: str | None = None) -> NoReturn:
    """The whole life of a forked child: it takes ``env``, ``cwd`` and the files ``stdout`` and
    ``stderr`` where given, calls ``run()``, and exits with the status ``python`` gives a
    program that does what ``run`` does: 0; ``sys.exit``'s code (a message printed, then 1);
    after an exception, its traceback and 1."""
    code = 1
    try:
        if cwd is not None:
            os.chdir(cwd)
        if env is not None:
            os.environ.clear()
            os.environ.update(env)
        for fd, path in ((1, stdout), (2, stderr)):
            if path is not None:
                target = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
                os.dup2(target, fd)
                os.close(target)
        try:
            run()
            code = 0
        except SystemExit as e:
            code = 0 if e.code is None else e.code if isinstance(e.code, int) else 1
            if not isinstance(e.code, int) and e.code is not None:
                print(e.code, file=sys.stderr)
    except BaseException:
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def run_argv(argv: Sequence[str]) -> None:
    """What ``python ARGV...`` runs: ``[SCRIPT, ARG...]`` or ``["-c", CODE, ARG...]``."""
    sys.argv = list(argv)
    if sys.argv[0] == "-c":
        exec(compile(sys.argv.pop(1), "<string>", "exec"), {"__name__": "__main__"})
    else:
        sys.path[0] = os.path.dirname(os.path.abspath(sys.argv[0]))
        runpy.run_path(sys.argv[0], run_name="__main__")


def serve(spec: Mapping[str, Any]) -> None:
    """The forking interpreter of :func:`start_forked`: ``spec`` is ``{"preload": [module, ...],
    "children": [{"env": {...}, "argv": [...]}, ...], "codes": a file or None}``. Exits 0 once
    every child has exited 0; says the children's exit statuses otherwise, and writes them
    (JSON, as Popen.returncode gives them) to ``codes`` where given."""
    for module in spec["preload"]:
        importlib.import_module(module)
    children = []
    for child in spec["children"]:
        pid = os.fork()
        if not pid:
            exit_as_python(lambda argv=child["argv"]: run_argv(argv), env=child["env"])
        children.append(pid)
    codes = [os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) for pid in children]
    if spec["codes"]:
        Path(spec["codes"]).write_text(json.dumps(codes))
    if codes != [0] * len(codes):
        sys.exit(f"the forked children's exit statuses: {codes}")


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
    forker = "import json, sys; from tests.forked import serve; serve(json.loads(sys.argv[1]))"
    path = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)
    return subprocess.Popen([sys.executable, "-c", forker, json.dumps(spec)],
                            env={**env, "PYTHONPATH": path}, cwd=cwd, start_new_session=True,
                            **popen)


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
