"""A job's run id (elasticft.home): the same script, worker counts and directory are the same job,
whatever the script's arguments; anything else gives another id, and an id the user gave wins.
A relaunch says what changed in the script's arguments since the previous launch."""

from __future__ import annotations

from pathlib import Path

import pytest

from elasticft import run
from elasticft.home import changed_arguments, derived_run_id, relaunch_line, script_arguments

BASE = dict(entry="/src/train.py", kind="script", nnodes="1", nproc_per_node="2", cwd="/work/a")


@pytest.mark.parametrize(
    ("change", "same_job"),
    [
        ({}, True),
        ({"nproc_per_node": "4"}, False),
        ({"nnodes": "1:2"}, False),
        ({"cwd": "/work/b"}, False),                      # another directory, another home
        ({"entry": "/src/other.py"}, False),
        ({"kind": "module", "entry": "train"}, False),
    ],
)
def test_derived_run_id_changes_exactly_with_what_was_launched(change: dict, same_job: bool
                                                               ) -> None:
    assert (derived_run_id(**{**BASE, **change}) == derived_run_id(**BASE)) is same_job


@pytest.mark.parametrize(
    ("entry", "kind", "prefix"),
    [
        ("/src/train.py", "script", "train-"),
        ("pkg.train", "module", "pkg.train-"),
        ("/usr/bin/my trainer", "program", "my_trainer-"),
        ("/src/__.py", "script", "job-"),
    ],
)
def test_derived_run_id_reads_as_the_script_name_and_a_digest(entry: str, kind: str,
                                                              prefix: str) -> None:
    run_id = derived_run_id(entry, kind, "1", "2", "/w")  # type: ignore[arg-type]
    assert run_id.startswith(prefix) and len(run_id) == len(prefix) + 10


def _run_id(argv: list[str], monkeypatch: pytest.MonkeyPatch, cwd: Path,
            env: dict[str, str] | None = None) -> str:
    monkeypatch.chdir(cwd)
    for name, value in (env or {}).items():
        monkeypatch.setenv(name, value)
    args, _ = run.parse(argv)
    run._apply_torchrun_defaults(args)
    return str(args.rdzv_id)


@pytest.mark.timeout(60)
def test_a_relaunch_in_the_same_directory_gets_the_same_run_id(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "train.py").write_text("")
    other = tmp_path / "other"
    other.mkdir()
    argv = ["--standalone", "--nproc-per-node", "2", "train.py", "--steps", "20"]
    first = _run_id(argv, monkeypatch, tmp_path)
    assert first.startswith("train-")
    # Launcher flags that vary per launch do not count; the script's path is its real path.
    assert _run_id(["--standalone", "--nproc-per-node", "2", "--max-restarts", "3",
                    "--ckpt-persist-every", "5", str(tmp_path / "train.py"), "--steps", "20"],
                   monkeypatch, tmp_path) == first
    # One static node is a single-node launch too.
    assert _run_id(["--nnodes", "1", "--nproc-per-node", "2", "train.py", "--steps", "20"],
                   monkeypatch, tmp_path) == first
    # Told to train longer, or anything else in the script's arguments: the same job.
    assert _run_id([*argv[:-1], "40"], monkeypatch, tmp_path) == first
    assert _run_id([*argv, "--lr", "0.1"], monkeypatch, tmp_path) == first
    assert _run_id(["--standalone", "--nproc-per-node", "4", "train.py", "--steps", "20"],
                   monkeypatch, tmp_path) != first
    assert _run_id(["--standalone", "--nproc-per-node", "2", str(tmp_path / "train.py"),
                    "--steps", "20"], monkeypatch, other) != first


@pytest.mark.timeout(60)
def test_a_given_rendezvous_id_wins_even_standalone(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "train.py").write_text("")
    assert _run_id(["--standalone", "--rdzv-id", "mine", "train.py"], monkeypatch,
                   tmp_path) == "mine"
    assert _run_id(["--standalone", "train.py"], monkeypatch, tmp_path,
                   {"PET_RDZV_ID": "from-env"}) == "from-env"


@pytest.mark.timeout(60)
def test_a_multi_node_launch_keeps_torchruns_id(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "train.py").write_text("")
    # Every node must agree on it; a derived id would differ with --node-rank.
    assert _run_id(["--nnodes", "2", "--rdzv-backend", "c10d", "--rdzv-endpoint",
                    "127.0.0.1:29400", "train.py"], monkeypatch, tmp_path) == "none"


@pytest.mark.parametrize(
    ("before", "after", "changes"),
    [
        (["--steps", "20"], ["--steps", "20"], []),
        (["--steps", "20"], ["--steps", "30"], ["--steps 20 -> 30"]),
        (["--steps=20"], ["--steps", "30"], ["--steps 20 -> 30"]),
        (["--steps", "20"], ["--steps", "20", "--lr", "0.1"], ["--lr 0.1 added"]),
        (["--fsdp2", "--steps", "20"], ["--steps", "20"], ["--fsdp2 removed"]),
        (["--offset", "-1"], ["--offset", "-2"], ["--offset -1 -> -2"]),  # a negative value
        (["data/a"], ["data/b"], ["argument 1 data/a -> data/b"]),
        (["--a", "1", "--b", "2"], ["--b", "2", "--a", "1"],
         ["the same arguments, reordered or repeated"]),
        (["x", "y"], ["y", "x"], ["argument 1 x -> y", "argument 2 y -> x"]),
        (["--v", "--v"], ["--v"], ["the same arguments, reordered or repeated"]),
        (["--quiet"], ["--quiet", "yes"], ["--quiet (flag) -> yes"]),
    ],
)
def test_changed_arguments_names_each_argument_that_changed(
        before: list[str], after: list[str], changes: list[str]) -> None:
    assert changed_arguments(before, after) == changes


@pytest.mark.parametrize(
    ("args", "script_args"),
    [
        (["-u", "train.py", "--steps", "20"], ["--steps", "20"]),
        (["-u", "-m", "pkg.train", "--steps", "20"], ["--steps", "20"]),
        (["--steps", "20"], ["--steps", "20"]),  # a program's (--no-python) own arguments
        (["-u", "train.py"], []),
    ],
)
def test_script_arguments_are_what_follows_the_script(args: list[str],
                                                      script_args: list[str]) -> None:
    assert script_arguments(args) == script_args


@pytest.mark.parametrize(
    ("step", "fresh", "line"),
    [
        (20, False, "relaunch of run r: resumes from its newest checkpoint, step 20 in /c; "
                    "script arguments changed since the last launch: --steps 20 -> 30; "
                    "--fresh starts over"),
        (None, False, "relaunch of run r: no committed checkpoint in /c (one the script keeps "
                      "elsewhere is restored from there); script arguments changed since the "
                      "last launch: --steps 20 -> 30; --fresh starts over"),
        (20, True, "relaunch of run r with --fresh: starts from step 0 (the checkpoints of "
                   "earlier launches are removed); script arguments changed since the last "
                   "launch: --steps 20 -> 30"),
    ],
)
def test_the_relaunch_line(step: int | None, fresh: bool, line: str) -> None:
    assert relaunch_line("r", ["-u", "t.py", "--steps", "20"], ["-u", "t.py", "--steps", "30"],
                         step, Path("/c"), fresh=fresh) == line
    # The same run directory given to another script: said too.
    assert relaunch_line("r", ["-u", "t.py"], ["-u", "u.py"], 3, Path("/c"),
                         scripts=("/s/t.py", "/s/u.py")) == (
        "relaunch of run r: resumes from its newest checkpoint, step 3 in /c; another script "
        "than the last launch (/s/t.py -> /s/u.py); the same script arguments as the last "
        "launch; --fresh starts over")


def _run(runs: Path, name: str, script: str | None, nproc: int, step: int | None) -> Path:
    from elasticft.ckpt.persisting import durable
    from elasticft.events import EventLog

    run_dir = runs / name
    log = EventLog(run_dir, "node")
    log.emit("workers_started", pids={})  # run_start need not come first
    log.emit("run_start", run_id=name, script=script, min_nodes=1, max_nodes=1,
             nproc_per_node=nproc)
    log.close()
    if step is not None:
        durable.step_dir(run_dir / "ckpt", step).mkdir(parents=True)
        (durable.step_dir(run_dir / "ckpt", step) / durable.COMMIT_MARKER).write_text("{}")
    return run_dir


@pytest.mark.timeout(60)
def test_a_new_run_beside_a_checkpoint_of_the_same_script_is_told_of_it(tmp_path: Path) -> None:
    from elasticft.home import elsewhere_line, same_script_elsewhere

    runs = tmp_path / "elasticft-runs"
    other = _run(runs, "train-4", "/src/train.py", 4, 20)
    _run(runs, "train-8", "/src/train.py", 8, None)          # no checkpoint: nothing to lose
    _run(runs, "eval-4", "/src/eval.py", 4, 7)               # another script
    own = runs / "train-2"
    own.mkdir()
    ((found, start, step),) = same_script_elsewhere(own, "/src/train.py")
    assert (found, start["run_id"], step) == (other, "train-4", 20)
    assert same_script_elsewhere(own, "/src/other.py") == []
    assert elsewhere_line("train-2", other, start, step, "1:1", 2) == (
        f"run train-2 starts from step 0, but the same script has a checkpoint (step 20) in "
        f"{other}, run train-4 (--nnodes 1:1 --nproc-per-node 4; this launch: --nnodes 1:1 "
        f"--nproc-per-node 2): another job. To continue that one, give --run-dir {other} (its "
        "checkpoint is resharded to this number of workers)")
