"""Warm start: a worker begun in a pre-started interpreter must be indistinguishable from one
started cold, for the script and for the agent watching it (real processes, real signals)."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import psutil
import pytest

from elasticft.agent.warmpool import (
    WarmInterpreter,
    WarmPool,
    bootstrap_dir,
    not_warm_startable,
    startup_mismatch,
)
from elasticft.events import read_events
from tests.conftest import BIN

HERE = Path(__file__).parent
SHOW = str(HERE / "workers" / "show_start.py")

def wait_until(predicate: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


def base_env(tmp_path: Path) -> dict[str, str]:
    env = {
        k: v for k, v in os.environ.items()
        if not k.startswith(("ELASTICFT_", "TORCHELASTIC_", "PET_", "SHOW_START"))
    }
    env.update(RANK="0", MASTER_PORT="1111", ELASTICFT_ATTEMPT="0", PYTHONUNBUFFERED="1")
    return env


def attempt_env(tmp_path: Path, tag: str) -> dict[str, str]:
    """The environment of a later attempt: per-attempt variables changed."""
    env = base_env(tmp_path)
    env.update(RANK="1", MASTER_PORT="2222", ELASTICFT_ATTEMPT="1", TORCHELASTIC_RESTART_COUNT="1",
               SHOW_START_TAG=tag)
    return env


def start_both(
    tmp_path: Path, mode: str, preload: tuple[str, ...] = ("json",),
    spawn_env: dict[str, str] | None = None,
) -> dict[str, dict]:
    """Runs show_start.py cold and warm with the same command and environment."""
    argv = [sys.executable, "-u", SHOW, str(tmp_path / "out"), mode]
    results = {}
    for how in ("cold", "warm"):
        env = attempt_env(tmp_path, how)
        out, err = tmp_path / f"{how}.out", tmp_path / f"{how}.err"
        with open(out, "w") as stdout, open(err, "w") as stderr:
            if how == "cold":
                proc = subprocess.Popen(argv, env=env, cwd=tmp_path, stdout=stdout,
                                        stderr=stderr, start_new_session=True)
            else:
                warm = WarmInterpreter.spawn(argv, spawn_env or base_env(tmp_path), str(tmp_path),
                                         preload)
                wait_until(warm.ready, 60, "the pre-started interpreter")
                proc = warm.start(argv, env, str(tmp_path), stdout.fileno(), stderr.fileno())
        code = proc.wait(timeout=60)
        results[how] = {
            "code": code,
            "stdout": out.read_text(),
            "stderr": err.read_text(),
            "state": json.loads((tmp_path / "out" / f"{how}.json").read_text()),
        }
    return results


@pytest.mark.timeout(120)
def test_the_worker_gets_the_agents_signal_dispositions_not_the_interpreters(
        tmp_path: Path) -> None:
    """An interpreter started while the agent ignored SIGINT (a job in the background) gives its
    worker SIGINT as a cold start from the agent would: the agent handles it by now, so Python's
    own handler; and a signal the agent ignores at the start stays ignored."""
    argv = [sys.executable, "-u", SHOW, str(tmp_path / "out"), "ok"]
    interrupt = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        warm = WarmInterpreter.spawn(argv, base_env(tmp_path), str(tmp_path), ("json",))
        wait_until(warm.ready, 60, "the pre-started interpreter")
    finally:
        # Handled at the start, whatever this test process was started with (a shell's
        # background job ignores SIGINT).
        signal.signal(signal.SIGINT, signal.default_int_handler)
    user1 = signal.signal(signal.SIGUSR1, signal.SIG_IGN)
    try:
        with open(tmp_path / "w.out", "w") as out, open(tmp_path / "w.err", "w") as err:
            proc = warm.start(argv, attempt_env(tmp_path, "warm"), str(tmp_path), out.fileno(),
                              err.fileno())
    finally:
        signal.signal(signal.SIGUSR1, user1)
        signal.signal(signal.SIGINT, interrupt)
    assert proc.wait(timeout=60) == 0
    signals = json.loads((tmp_path / "out" / "warm.json").read_text())["signals"]
    assert signals["SIGINT"] == repr(signal.default_int_handler)
    assert signals["SIGUSR1"] == repr(signal.SIG_IGN)
    assert signals["SIGTERM"] == repr(signal.SIG_DFL)


def comparable(state: dict) -> dict:
    """A start's state without what names the process itself."""
    state = json.loads(json.dumps(state))
    state["env"].pop("SHOW_START_TAG")
    state.pop("pid")
    if state["sitecustomize"] == str(bootstrap_dir() / "sitecustomize.py"):
        # Known difference: with no sitecustomize of its own to hand over to, the warm
        # bootstrap stays in sys.modules (a cold interpreter has none there).
        state["sitecustomize"] = None
    return state


# ----------------------------------------------------------------------------------------------
# Pure decisions.


def test_only_torchrun_style_python_commands_are_warm_startable(tmp_path: Path) -> None:
    python = sys.executable
    assert not_warm_startable([python, "-u", "train.py", "--x"]) is None
    assert not_warm_startable([python, "-u", "-m", "pkg.train"]) is None
    assert "not a Python interpreter" in not_warm_startable(["/bin/sh", "-u", "train.py"])
    assert "'-u'" in not_warm_startable([python, "-I", "train.py"])
    assert "not supported" in not_warm_startable([python, "-u", "-E", "train.py"])
    assert not_warm_startable([python, "-u"]) is not None


def test_only_per_attempt_variables_may_change_after_start_up() -> None:
    started = {"RANK": "0", "MASTER_PORT": "1", "TORCHELASTIC_RESTART_COUNT": "0",
               "ELASTICFT_ROUND": "0", "OMP_NUM_THREADS": "1", "PYTHONPATH": "/a"}
    later = {**started, "RANK": "1", "MASTER_PORT": "2", "TORCHELASTIC_RESTART_COUNT": "1",
             "ELASTICFT_ROUND": "3", "LOCAL_RANK": "1"}
    assert startup_mismatch(started, later) == []
    changed = {**later, "OMP_NUM_THREADS": "2", "LD_PRELOAD": "/x.so"}
    del changed["PYTHONPATH"]
    assert startup_mismatch(started, changed) == ["LD_PRELOAD", "OMP_NUM_THREADS", "PYTHONPATH"]


# ----------------------------------------------------------------------------------------------
# One interpreter against a cold start.


@pytest.mark.timeout(120)
def test_script_sees_the_same_start_as_cold(tmp_path: Path) -> None:
    results = start_both(tmp_path, "ok")
    cold, warm = results["cold"], results["warm"]
    assert cold["code"] == warm["code"] == 0
    assert comparable(warm["state"]) == comparable(cold["state"])
    assert warm["state"]["env"]["RANK"] == "1"  # the start request's, not the pre-start's
    assert warm["state"]["argv"] == [SHOW, str(tmp_path / "out"), "ok"]
    assert warm["state"]["group_leader"] and warm["state"]["session_leader"]
    assert (cold["stdout"], warm["stdout"]) == ("started cold\n", "started warm\n")


@pytest.mark.timeout(120)
@pytest.mark.parametrize("mode", ["exit3", "raise", "sysexit-msg"])
def test_exit_codes_and_tracebacks_are_the_scripts_own(tmp_path: Path, mode: str) -> None:
    results = start_both(tmp_path, mode)
    cold, warm = results["cold"], results["warm"]
    assert warm["code"] == cold["code"] != 0
    assert warm["stderr"] == cold["stderr"]
    if mode == "raise":
        assert "Traceback (most recent call last)" in warm["stderr"]
        assert "sitecustomize" not in warm["stderr"]
        assert warm["stderr"].rstrip().endswith("ValueError: bad value from the script")


@pytest.mark.timeout(120)
def test_output_of_the_preload_imports_reaches_the_workers_streams(tmp_path: Path) -> None:
    noisy = tmp_path / "mods"
    noisy.mkdir()
    (noisy / "noisy_import.py").write_text(
        "import sys\nprint('imported noisily')\nprint('warning from import', file=sys.stderr)\n"
    )
    env = base_env(tmp_path)
    env["PYTHONPATH"] = str(noisy)
    env["SHOW_START_IMPORT"] = "noisy_import"
    argv = [sys.executable, "-u", SHOW, str(tmp_path / "out")]
    started_env = {**attempt_env(tmp_path, "warm"), "PYTHONPATH": str(noisy),
                   "SHOW_START_IMPORT": "noisy_import"}
    warm = WarmInterpreter.spawn(argv, env | {"SHOW_START_TAG": "warm"}, str(tmp_path),
                             ("noisy_import",))
    wait_until(warm.ready, 60, "the pre-started interpreter")
    with open(tmp_path / "o", "w") as out, open(tmp_path / "e", "w") as err:
        proc = warm.start(argv, started_env, str(tmp_path), out.fileno(), err.fileno())
        assert proc.wait(timeout=60) == 0
    assert (tmp_path / "o").read_text() == "imported noisily\nstarted warm\n"
    assert (tmp_path / "e").read_text() == "warning from import\n"


@pytest.mark.timeout(120)
def test_a_failed_preload_falls_back_to_a_cold_start_in_the_same_process(tmp_path: Path) -> None:
    results = start_both(tmp_path, "ok", preload=("no_such_module_anywhere",))
    cold, warm = results["cold"], results["warm"]
    assert warm["code"] == 0
    assert comparable(warm["state"]) == comparable(cold["state"])


@pytest.mark.timeout(120)
def test_sigterm_to_the_process_group_stops_a_warm_worker(tmp_path: Path) -> None:
    argv = [sys.executable, "-u", SHOW, str(tmp_path / "out"), "sleep"]
    warm = WarmInterpreter.spawn(argv, base_env(tmp_path), str(tmp_path), ("json",))
    proc = warm.start(argv, attempt_env(tmp_path, "w"), str(tmp_path), 1, 2)
    wait_until((tmp_path / "out" / "w.json").exists, 60, "the worker to start")
    os.killpg(proc.pid, signal.SIGTERM)  # how torch stops a worker
    assert proc.wait(timeout=30) == -signal.SIGTERM


@pytest.mark.timeout(120)
def test_sigkill_of_a_warm_worker_leaves_nothing_running(tmp_path: Path) -> None:
    argv = [sys.executable, "-u", SHOW, str(tmp_path / "out"), "sleep"]
    pool = WarmPool(preload=("json",))
    pool.refill(0, argv, {**base_env(tmp_path), "SHOW_START_TAG": "w"}, str(tmp_path))
    wait_until(lambda: 0 in pool.interpreters() and pool.interpreters()[0].ready(), 60,
               "the pool")
    warm = pool.take(0, argv, attempt_env(tmp_path, "w"), str(tmp_path))
    assert warm is not None
    proc = warm.start(argv, attempt_env(tmp_path, "w"), str(tmp_path), 1, 2)
    wait_until((tmp_path / "out" / "w.json").exists, 60, "the worker to start")
    session = os.getsid(proc.pid)
    os.kill(proc.pid, signal.SIGKILL)  # the watched process itself, as `elasticft chaos kill`
    assert proc.wait(timeout=30) == -signal.SIGKILL
    left = [p for p in psutil.process_iter() if _session(p) == session]
    assert left == []
    assert warm.alive()  # the interpreter stays for the next start
    pool.close()


@pytest.mark.timeout(120)
def test_one_interpreter_forks_a_fresh_worker_for_every_start(tmp_path: Path) -> None:
    argv = [sys.executable, "-u", SHOW, str(tmp_path / "out"), "sleep"]
    warm = WarmInterpreter.spawn(argv, base_env(tmp_path), str(tmp_path), ("json",))
    try:
        workers = []
        for tag in ("first", "second"):
            proc = warm.start(argv, attempt_env(tmp_path, tag), str(tmp_path), 1, 2)
            wait_until((tmp_path / "out" / f"{tag}.json").exists, 60, f"worker {tag}")
            # The worker is this process's own child, in a session of its own.
            assert psutil.Process(proc.pid).ppid() == os.getpid()
            assert os.getsid(proc.pid) == proc.pid
            workers.append(proc)
        first, second = (json.loads((tmp_path / "out" / f"{t}.json").read_text())
                         for t in ("first", "second"))
        assert first["pid"] != second["pid"] and warm.proc.pid not in (first["pid"],
                                                                        second["pid"])
        assert first["env"]["SHOW_START_TAG"] == "first"
        assert second["env"]["SHOW_START_TAG"] == "second"
        for proc in workers:
            os.killpg(proc.pid, signal.SIGTERM)
            assert proc.wait(timeout=30) == -signal.SIGTERM
        assert warm.alive() and warm.starts == 2
    finally:
        warm.discard()
    # Nothing else was adopted: the subreaper flag was held only around each fork.
    assert _is_subreaper() is False


def _is_subreaper() -> bool:
    import ctypes

    from elasticft.procs import _PR_GET_CHILD_SUBREAPER

    flag = ctypes.c_int(0)
    ctypes.CDLL(None).prctl(_PR_GET_CHILD_SUBREAPER, ctypes.byref(flag), 0, 0, 0)
    return bool(flag.value)


@pytest.mark.timeout(120)
def test_interpreters_never_started_exit_without_running_the_script(tmp_path: Path) -> None:
    argv = [sys.executable, "-u", SHOW, str(tmp_path / "out"), "ok"]
    pool = WarmPool(preload=("json",))
    for rank in (0, 1):
        pool.refill(rank, argv, base_env(tmp_path), str(tmp_path))
    wait_until(lambda: len(pool.interpreters()) == 2, 60, "the pool")
    (template,) = pool.templates()  # one for both local ranks
    pool.close()
    assert template.proc.wait(timeout=30) in (0, -9)
    assert pool.interpreters() == {}
    # The agent disappearing (its end of the socket closed) also ends them.
    orphan = WarmInterpreter.spawn(argv, base_env(tmp_path), str(tmp_path), ("json",))
    orphan._channel.close()
    assert orphan.proc.wait(timeout=60) == 0
    assert not (tmp_path / "out").exists()


@pytest.mark.timeout(120)
def test_a_changed_start_up_environment_starts_cold(tmp_path: Path) -> None:
    argv = [sys.executable, "-u", SHOW, str(tmp_path / "out"), "ok"]
    pool = WarmPool(preload=("json",))
    pool.refill(0, argv, base_env(tmp_path), str(tmp_path))
    wait_until(lambda: 0 in pool.interpreters(), 60, "the pool")
    idle = pool.interpreters()[0]
    changed = {**attempt_env(tmp_path, "w"), "OMP_NUM_THREADS": "7"}
    assert pool.take(0, argv, changed, str(tmp_path)) is None
    assert idle.proc.wait(timeout=30) in (0, -signal.SIGKILL)
    assert pool.interpreters() == {}  # the next refill starts one with the new environment
    pool.close()


# ----------------------------------------------------------------------------------------------
# One template per node: every local rank is forked from it.


def rank_env(tmp_path: Path, local_rank: int) -> dict[str, str]:
    """A later attempt's environment of ``local_rank`` (show_start writes attempt1-rankN)."""
    env = {**attempt_env(tmp_path, ""), "LOCAL_RANK": str(local_rank), "RANK": str(local_rank)}
    del env["SHOW_START_TAG"]
    return env


@pytest.mark.timeout(120)
def test_every_local_rank_is_forked_from_one_template(tmp_path: Path) -> None:
    argv = [sys.executable, "-u", SHOW, str(tmp_path / "out"), "sleep"]
    pool = WarmPool(preload=("json",))
    try:
        for rank in (0, 1, 2):
            pool.refill(rank, argv, {**base_env(tmp_path), "LOCAL_RANK": str(rank)},
                        str(tmp_path))
        wait_until(lambda: len(pool.interpreters()) == 3, 60, "the pool")
        (template,) = pool.templates()
        assert pool.spawned == 1  # one interpreter imported the preload modules
        workers = {}
        for rank in (0, 1, 2):
            warm = pool.take(rank, argv, rank_env(tmp_path, rank), str(tmp_path))
            assert warm is template
            workers[rank] = warm.start(argv, rank_env(tmp_path, rank), str(tmp_path), 1, 2)
        for rank, proc in workers.items():
            out = tmp_path / "out" / f"attempt1-rank{rank}.json"
            wait_until(out.exists, 60, f"local rank {rank}")
            state = json.loads(out.read_text())
            assert state["env"]["LOCAL_RANK"] == str(rank) and state["pid"] == proc.pid
            worker = psutil.Process(proc.pid)
            assert worker.ppid() == os.getpid()  # the agent's own child
            # A fork of the template: the kernel's copy of the environment is the template's
            # start-up one (its bootstrap socket included), not the worker's.
            assert worker.environ() == psutil.Process(template.proc.pid).environ()
        assert template.starts == 3 and template.alive() and pool.spawned == 1
        for proc in workers.values():
            os.killpg(proc.pid, signal.SIGTERM)
            assert proc.wait(timeout=30) == -signal.SIGTERM
    finally:
        pool.close()


@pytest.mark.timeout(120)
def test_a_dead_template_sends_every_rank_cold_and_one_new_template_replaces_it(
        tmp_path: Path) -> None:
    argv = [sys.executable, "-u", SHOW, str(tmp_path / "out"), "ok"]
    pool = WarmPool(preload=("json",))
    try:
        for rank in (0, 1, 2):
            pool.refill(rank, argv, base_env(tmp_path), str(tmp_path))
        wait_until(lambda: len(pool.interpreters()) == 3, 60, "the pool")
        (dead,) = pool.templates()
        os.killpg(dead.proc.pid, signal.SIGKILL)
        assert dead.proc.wait(timeout=30) == -signal.SIGKILL
        # The first rank to start finds it dead: it is ended for every rank, which all go cold.
        assert pool.take(0, argv, rank_env(tmp_path, 0), str(tmp_path)) is None
        assert pool.interpreters() == {}
        assert pool.take(1, argv, rank_env(tmp_path, 1), str(tmp_path)) is None
        for rank in (0, 1, 2):  # what the agent does after the cold starts
            pool.refill(rank, argv, rank_env(tmp_path, rank), str(tmp_path))
        wait_until(lambda: len(pool.interpreters()) == 3, 60, "the new template")
        (new,) = pool.templates()
        assert new is not dead and pool.spawned == 2
        wait_until(new.ready, 60, "the new template's imports")
        proc = new.start(argv, rank_env(tmp_path, 2), str(tmp_path), 1, 2)
        assert proc.wait(timeout=60) == 0
    finally:
        pool.close()


@pytest.mark.timeout(120)
def test_a_local_rank_with_another_command_gets_a_template_of_its_own(tmp_path: Path) -> None:
    out = str(tmp_path / "out")
    pool = WarmPool(preload=("json",))
    try:
        pool.refill(0, [sys.executable, "-u", SHOW, out, "ok"], base_env(tmp_path), str(tmp_path))
        pool.refill(1, [sys.executable, "-u", SHOW, out, "ok"], base_env(tmp_path), str(tmp_path))
        pool.refill(2, [sys.executable, "-u", SHOW, out, "exit3"], base_env(tmp_path),
                    str(tmp_path))
        wait_until(lambda: len(pool.interpreters()) == 3, 60, "the pool")
        shared = pool.interpreters()
        assert shared[0] is shared[1] is not shared[2] and pool.spawned == 2
    finally:
        pool.close()


def _session(process: psutil.Process) -> int | None:
    try:
        return os.getsid(process.pid)
    except OSError:
        return None


# ----------------------------------------------------------------------------------------------
# Under elasticft-run, with torch preloaded.


def run_show_start(tmp_path: Path, job_env: dict[str, str], name: str, *extra: str,
                   nproc: int = 2) -> Path:
    """elasticft-run of show_start.py on ``nproc`` local ranks whose first attempt is
    SIGKILLed. Its stderr (INFO lines) is kept as ``stderr-<name>.txt``."""
    run_dir, out = tmp_path / f"run-{name}", tmp_path / f"out-{name}"
    env = {**job_env, "SHOW_START_IMPORT": "torch", "LOGLEVEL": "INFO"}
    proc = subprocess.run(
        [str(BIN / "elasticft-run"), "--standalone", "--nproc-per-node", str(nproc),
         "--max-restarts",
         "2", *extra, "--run-dir", str(run_dir), SHOW, str(out), "kill-first"],
        env=env, cwd=tmp_path, capture_output=True, text=True, timeout=200,
    )
    assert proc.returncode == 0, proc.stderr
    (tmp_path / f"stderr-{name}.txt").write_text(proc.stderr)
    return run_dir


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_every_start_is_warm_and_sees_what_a_cold_one_sees(
    tmp_path: Path, job_env: dict[str, str]
) -> None:
    cold_run = run_show_start(tmp_path, job_env, "cold", "--warm-start", "false")
    warm_run = run_show_start(tmp_path, job_env, "warm")
    started = {run: [e["warm_local_ranks"] for e in read_events(run) if e["kind"] ==
                     "workers_started"] for run in (cold_run, warm_run)}
    # Turned off, every start is cold; on, the first start and the restart are both forked.
    assert started == {cold_run: [[], []], warm_run: [[0, 1], [0, 1]]}
    # The first start forks the interpreters started before the rendezvous: their start-up
    # environment is the workers' (torch's TORCH_NCCL_ASYNC_ERROR_HANDLING included), so none
    # is discarded for another that imports torch again.
    warm_log = (tmp_path / "stderr-warm.txt").read_text()
    assert "starts cold" not in warm_log, warm_log[-3000:]
    for attempt, rank in ((0, 0), (0, 1), (1, 0), (1, 1)):
        states = []
        for name in ("cold", "warm"):
            text = (tmp_path / f"out-{name}" / f"attempt{attempt}-rank{rank}.json").read_text()
            # The two runs differ only in their own directories' names.
            state = json.loads(text.replace(f"out-{name}", "out").replace(f"run-{name}", "run"))
            # Diagnostics installed their recorder for this very process, warm or cold.
            owner = state["env"].get("ELASTICFT_DIAG_OWNER_PID")
            assert owner in (None, str(state.pop("pid")))
            for key in state["env"]:  # bound per run or per attempt: names must match
                if key == "MASTER_PORT" or key.startswith(("ELASTICFT_", "TORCHELASTIC_")):
                    state["env"][key] = "<per run>"
            states.append(state)
        cold, warm = states
        assert warm == cold
        # Diagnostics' bootstrap (first on PYTHONPATH) still ran and installed the recorder.
        if cold["sitecustomize"]:
            assert "diag" in cold["sitecustomize"]


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_a_three_worker_launch_imports_torch_once(tmp_path: Path, job_env: dict[str, str]) -> None:
    """Every worker of both attempts is forked from one template, the only interpreter of the
    node that imported torch."""
    run = run_show_start(tmp_path, job_env, "three", nproc=3)
    started = [e["warm_local_ranks"] for e in read_events(run) if e["kind"] == "workers_started"]
    assert started == [[0, 1, 2], [0, 1, 2]]
    log = (tmp_path / "stderr-three.txt").read_text()
    spawned = re.findall(r"warm template (\d+) started \(imports torch,torch._dynamo,", log)
    forked = re.findall(r"local rank (\d): worker (\d+) forked from warm template (\d+)", log)
    assert len(spawned) == 1, log[-3000:]
    assert sorted(int(rank) for rank, _, _ in forked) == [0, 0, 1, 1, 2, 2]
    assert {template for _, _, template in forked} == set(spawned)
    pids = {json.loads(p.read_text())["pid"] for p in (tmp_path / "out-three").glob("*.json")}
    assert pids == {int(worker) for _, worker, _ in forked} and len(pids) == 6
