"""What launch() does with the caller's worker logs: stderr teed where it went nowhere, torch's
temporary directory replaced by the run directory's, everything else the caller chose kept."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from elasticft.launcher import with_stderr_teed, worker_logs
from elasticft.torch_compat import DefaultLogsSpecs, LogsSpecs, Std, default_logs_streams

N, OUT, E, A = Std.NONE, Std.OUT, Std.ERR, Std.ALL


@pytest.mark.parametrize(("redirects", "tee", "expected"), [
    (N, N, E),  # nothing asked: stderr teed
    (N, OUT, A),  # stdout teed by the caller: stderr too
    (E, N, N),  # stderr redirected to a file already
    (A, N, N),
    (N, E, E),
    (OUT, N, E),  # stdout redirected, stderr on the console only: teed
    ({0: E}, N, {0: N, 1: E}),  # per local rank
    (N, {1: OUT}, {0: E, 1: A}),
])
def test_stderr_is_teed_only_where_it_went_nowhere(redirects, tee, expected) -> None:
    assert with_stderr_teed(redirects, tee, 2) == expected


def streams(specs: LogsSpecs) -> tuple[str, object, object, object]:
    fields = default_logs_streams(specs)
    assert fields is not None
    return fields


def test_torchs_default_logs_go_to_the_run_directory_with_stderr_teed(tmp_path: Path) -> None:
    torch_default = DefaultLogsSpecs()  # what LaunchConfig makes: a new /tmp/torchelastic_*
    temporary = Path(torch_default.root_log_dir)
    specs = worker_logs(torch_default, tmp_path / "run", 2, capture_stderr=True)
    assert streams(specs) == (str(tmp_path / "run" / "logs"), N, E, None)
    assert not temporary.exists()
    none_given = worker_logs(None, tmp_path / "run", 2, capture_stderr=True)
    assert streams(none_given) == (str(tmp_path / "run" / "logs"), N, E, None)
    not_captured = worker_logs(DefaultLogsSpecs(), tmp_path / "run", 2, capture_stderr=False)
    assert streams(not_captured) == (str(tmp_path / "run" / "logs"), N, N, None)


def test_the_callers_choices_are_kept(tmp_path: Path) -> None:
    redirected = DefaultLogsSpecs(str(tmp_path / "mine"), redirects=A, local_ranks_filter={0})
    assert worker_logs(redirected, tmp_path / "run", 2, capture_stderr=True) is redirected
    teed_out = DefaultLogsSpecs(str(tmp_path / "mine"), tee=OUT, local_ranks_filter={0})
    assert streams(worker_logs(teed_out, tmp_path / "run", 2, capture_stderr=True)) == (
        str(tmp_path / "mine"), N, A, {0})
    nowhere = DefaultLogsSpecs(os.devnull)
    assert worker_logs(nowhere, tmp_path / "run", 2, capture_stderr=True) is nowhere


def test_a_logs_specs_of_another_kind_is_used_as_it_is(tmp_path: Path) -> None:
    class Mine(DefaultLogsSpecs):
        pass

    mine = Mine(str(tmp_path / "mine"))
    assert worker_logs(mine, tmp_path / "run", 2, capture_stderr=True) is mine
