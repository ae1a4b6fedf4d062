"""Worker that records what a script can see of how it was started, then does what it is told.

    show_start.py OUT_DIR [MODE]

Writes OUT_DIR/<tag>.json (tag: $SHOW_START_TAG, else attempt<ELASTICFT_ATTEMPT>-rank<RANK>)
with argv, sys.path, cwd, environment, __main__'s attributes, the sitecustomize that ran,
interpreter flags, process group, signal and garbage collector state.
MODE: ``ok`` (exit 0, the default),
``exit3``, ``raise`` (ValueError), ``sysexit-msg``, ``sleep`` (wait for a signal),
``kill-first`` (SIGKILL itself on attempt 0 once every local rank has written, exit 0
later). With $SHOW_START_IMPORT it first
imports that module (e.g. torch, so diagnostics install as in a training script).
"""

MAIN_NAMES = sorted(globals())

import gc  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import signal  # noqa: E402
import sys  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

if os.environ.get("SHOW_START_IMPORT"):
    __import__(os.environ["SHOW_START_IMPORT"])

out = Path(sys.argv[1])
mode = sys.argv[2] if len(sys.argv) > 2 else "ok"
main = sys.modules["__main__"]
site_module = sys.modules.get("sitecustomize")
state = {
    "pid": os.getpid(),
    "argv": sys.argv,
    "orig_argv": sys.orig_argv,
    "path": sys.path,
    "cwd": os.getcwd(),
    "env": dict(os.environ),
    "main_names": MAIN_NAMES,
    "main": {k: repr(getattr(main, k, None)) for k in ("__name__", "__file__", "__package__",
                                                        "__spec__", "__cached__")},
    "loader": type(getattr(main, "__loader__", None)).__name__,
    "is_main": __name__ == "__main__",
    "sitecustomize": getattr(site_module, "__file__", None),
    "flags": repr(sys.flags),
    "executable": sys.executable,
    "stdout_line_buffering": sys.stdout.line_buffering,
    "group_leader": os.getpgid(0) == os.getpid(),
    "session_leader": os.getsid(0) == os.getpid(),
    "signals": {s.name: repr(signal.getsignal(s)) for s in (signal.SIGTERM, signal.SIGINT,
                                                           signal.SIGUSR1, signal.SIGPIPE)},
    "blocked": sorted(int(s) for s in signal.pthread_sigmask(signal.SIG_BLOCK, [])),
    "torch_imported": "torch" in sys.modules,
    "threads": sorted(t.name for t in threading.enumerate()),
    "nice": os.getpriority(os.PRIO_PROCESS, 0),  # the warm imports run at nice 19, apart
    "gc_enabled": gc.isenabled(),  # the warm imports run without collections, apart
}
tag = os.environ.get("SHOW_START_TAG") or (
    f"attempt{os.environ.get('ELASTICFT_ATTEMPT', '0')}-rank{os.environ.get('RANK', '0')}"
)
out.mkdir(parents=True, exist_ok=True)
# Renamed into place: the test waits for the file to exist, then reads it.
(out / f".{tag}.json.tmp").write_text(json.dumps(state, indent=1))
(out / f".{tag}.json.tmp").replace(out / f"{tag}.json")
print(f"started {tag}", flush=True)

if mode == "exit3":
    sys.exit(3)
elif mode == "raise":
    raise ValueError("bad value from the script")
elif mode == "sysexit-msg":
    sys.exit("a message instead of an exit code")
elif mode == "sleep":
    while True:
        time.sleep(1)
elif mode == "kill-first" and os.environ.get("ELASTICFT_ATTEMPT", "0") == "0":
    # Once every local rank has written its record, so that none is stopped before it has.
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and len(list(out.glob("attempt0-*.json"))) < int(
        os.environ.get("LOCAL_WORLD_SIZE", "1")
    ):
        time.sleep(0.05)
    os.kill(os.getpid(), signal.SIGKILL)
