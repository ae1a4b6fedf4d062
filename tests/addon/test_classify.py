"""Failure classification from exit codes, torch error files and captured stderr."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

import elasticft
from elasticft.addon.classify import (
    LEAVING_WINDOW_S,
    FailureClass,
    classify_exception,
    classify_exit,
    own_exception_at_exit,
    parse_traceback,
)

USER_TRACEBACK = """\
[rank1]: Traceback (most recent call last):
[rank1]:   File "/job/train.py", line 115, in main
[rank1]:     _ = step / steps_per_epoch
[rank1]:         ~~~~~^~~~~~~~~~~~~~~~~
[rank1]: ZeroDivisionError: division by zero
"""

GLOO_TRACEBACK = """\
Traceback (most recent call last):
  File "/job/train.py", line 90, in <module>
    loss.backward()
  File "/torch/autograd/__init__.py", line 10, in backward
    run()
RuntimeError: [gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:3235
"""


def stderr_file(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "stderr.log"
    path.write_text("some output\n" + text)
    return path


def test_user_error_from_stderr_names_exception_and_line(tmp_path: Path) -> None:
    record = classify_exit(1, 1, 42, 1, stderr_file=stderr_file(tmp_path, USER_TRACEBACK))
    assert record.failure_class is FailureClass.USER_CODE
    assert record.exception == "ZeroDivisionError"
    assert record.message == "division by zero"
    assert record.location == "/job/train.py:115 in main"
    assert record.source == "stderr"
    assert "rank 1" in record.summary() and "ZeroDivisionError" in record.summary()


def test_gloo_runtime_error_is_infrastructure(tmp_path: Path) -> None:
    record = classify_exit(0, 0, 1, 1, stderr_file=stderr_file(tmp_path, GLOO_TRACEBACK))
    assert record.failure_class is FailureClass.INFRASTRUCTURE
    assert record.exception == "RuntimeError"


def test_teed_lines_with_double_prefix_parse() -> None:
    teed = "\n".join(f"[default1]:{line}" for line in USER_TRACEBACK.splitlines())
    info = parse_traceback(teed)
    assert info is not None and info.type_name == "ZeroDivisionError"


def test_last_traceback_wins() -> None:
    info = parse_traceback(GLOO_TRACEBACK + "\n" + USER_TRACEBACK)
    assert info is not None and info.type_name == "ZeroDivisionError"


def test_error_file_preferred_over_stderr(tmp_path: Path) -> None:
    error_file = tmp_path / "error.json"
    error_file.write_text(
        json.dumps(
            {"message": {"message": "NameError: name 'x' is not defined",
                         "extraInfo": {"py_callstack": "", "timestamp": "0"}}}
        )
    )
    record = classify_exit(
        3, 1, 7, 1, error_file=error_file, stderr_file=stderr_file(tmp_path, GLOO_TRACEBACK)
    )
    assert record.failure_class is FailureClass.USER_CODE
    assert record.exception == "NameError"
    assert record.source == "error_file"


@pytest.mark.parametrize(
    ("exitcode", "expected", "signal_name"),
    [
        (-9, FailureClass.SIGNAL_CRASH, "SIGKILL"),
        (-11, FailureClass.SIGNAL_CRASH, "SIGSEGV"),
        (137, FailureClass.SIGNAL_CRASH, "SIGKILL"),
        (-15, FailureClass.STOP_REQUESTED, "SIGTERM"),
        (-2, FailureClass.STOP_REQUESTED, "SIGINT"),
    ],
)
def test_signals(exitcode: int, expected: FailureClass, signal_name: str) -> None:
    record = classify_exit(0, 0, 1, exitcode)
    assert record.failure_class is expected
    assert record.signal == signal_name


TERMINATE = "terminate called without an active exception\n"


def user_error_file(tmp_path: Path) -> Path:
    error_file = tmp_path / "error.json"
    error_file.write_text(json.dumps({"message": {
        "message": "ValueError: bad config value",
        "extraInfo": {"py_callstack": "", "timestamp": "0"}}}))
    return error_file


@pytest.mark.parametrize(
    ("exitcode", "error_file", "stderr", "expected", "source"),
    [
        # the exception left the entrypoint, then a gloo thread aborted the interpreter's exit
        (-6, True, "", FailureClass.USER_CODE, "error_file"),
        (-9, True, "", FailureClass.USER_CODE, "error_file"),
        (-6, False, USER_TRACEBACK + TERMINATE, FailureClass.USER_CODE, "stderr"),
        (-6, False, USER_TRACEBACK + "[rank1]: " + TERMINATE, FailureClass.USER_CODE, "stderr"),
        # a traceback caught and logged long before a crash of its own is not its cause
        (-6, False, USER_TRACEBACK + "step 7 loss 0.3\n" + TERMINATE,
         FailureClass.SIGNAL_CRASH, "exitcode"),
        (-6, False, TERMINATE, FailureClass.SIGNAL_CRASH, "exitcode"),
        (-9, False, USER_TRACEBACK, FailureClass.SIGNAL_CRASH, "exitcode"),
        (-11, False, USER_TRACEBACK + TERMINATE, FailureClass.SIGNAL_CRASH, "exitcode"),
        (-15, False, USER_TRACEBACK, FailureClass.STOP_REQUESTED, "exitcode"),
    ],
)
def test_an_exception_is_the_cause_of_the_abort_that_follows_it(
        tmp_path: Path, exitcode: int, error_file: bool, stderr: str, expected: FailureClass,
        source: str) -> None:
    record = classify_exit(1, 1, 7, exitcode,
                           error_file=user_error_file(tmp_path) if error_file else None,
                           stderr_file=stderr_file(tmp_path, stderr))
    assert (record.failure_class, record.source) == (expected, source)
    assert record.signal is not None


@pytest.mark.parametrize(
    ("stderr", "written_before_s", "expected"),
    [
        # stopped after a peer's failure, or about to be, while leaving on its own bug
        (USER_TRACEBACK, 1.0, FailureClass.USER_CODE),
        (USER_TRACEBACK + TERMINATE, 1.0, FailureClass.USER_CODE),
        (USER_TRACEBACK, LEAVING_WINDOW_S - 1, FailureClass.USER_CODE),
        # a traceback printed long before, which the script went on from silently
        (USER_TRACEBACK, LEAVING_WINDOW_S + 1, None),
        # its traceback is the echo of the peer, or was followed by more work: collateral
        (GLOO_TRACEBACK, 1.0, None),
        (USER_TRACEBACK + "step 7 loss 0.3\n", 1.0, None),
        ("", 1.0, None),
    ],
)
def test_a_worker_stopped_while_leaving_on_its_own_exception_is_classed_by_it(
        tmp_path: Path, stderr: str, written_before_s: float, expected: FailureClass | None
        ) -> None:
    path = stderr_file(tmp_path, stderr)
    seen_at = 1_800_000_000.0
    os.utime(path, (seen_at - written_before_s, seen_at - written_before_s))
    record = own_exception_at_exit(1, 1, 7, -15, path, seen_at=seen_at)
    assert (record.failure_class if record else None) is expected
    if record is not None:
        assert (record.exitcode, record.source, record.exception) == (
            -15, "stderr", "ZeroDivisionError")


def test_nothing_known_is_unknown(tmp_path: Path) -> None:
    record = classify_exit(0, 0, 1, 3, stderr_file=stderr_file(tmp_path, "no traceback here\n"))
    assert record.failure_class is FailureClass.UNKNOWN


def test_cuda_oom_is_infrastructure() -> None:
    info = parse_traceback(
        "Traceback (most recent call last):\n  File \"t.py\", line 1, in <module>\n"
        "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB\n"
    )
    assert info is not None
    from elasticft.addon.classify import classify_exception

    assert classify_exception(info) is FailureClass.INFRASTRUCTURE


TORCH_DIR = Path(torch.__file__).parent
ELASTICFT_DIR = Path(elasticft.__file__).parent


def traceback_through(*frames: Path | str, error: str = "RuntimeError: size mismatch") -> str:
    lines = ["Traceback (most recent call last):"]
    for i, file in enumerate(frames):
        lines += [f'  File "{file}", line {10 + i}, in f{i}', "    call()"]
    return "\n".join([*lines, error, ""])


@pytest.mark.parametrize(("frames", "error", "cls", "user_frame"), [
    # elasticft's restore path raised (through torch's load_state_dict): elasticft's failure.
    (("/job/train.py", ELASTICFT_DIR / "ckpt" / "restore.py", TORCH_DIR / "nn" / "module.py"),
     "RuntimeError: size mismatch for 0.weight", FailureClass.ELASTICFT, "/job/train.py:10"),
    (("/job/train.py", ELASTICFT_DIR / "ckpt" / "restore.py"), "ValueError: bad shard",
     FailureClass.ELASTICFT, "/job/train.py:10"),
    # A communication fault stays one, wherever it surfaced.
    (("/job/train.py", ELASTICFT_DIR / "ckpt" / "peer.py"), "ConnectionResetError: reset",
     FailureClass.INFRASTRUCTURE, "/job/train.py:10"),
    # A survivor that leaves with in-process recovery's interrupt (a BaseException, raised in
    # elasticft's hook, with or without a message): its peer's failure, not its own.
    (("/job/train.py", ELASTICFT_DIR / "recovery" / "inprocess.py"),
     "elasticft.inprocess.interrupt.PeerInterrupted: not committed: generation 0 ended",
     FailureClass.INFRASTRUCTURE, "/job/train.py:10"),
    (("/job/train.py",), "elasticft.inprocess.interrupt.PeerInterrupted",
     FailureClass.INFRASTRUCTURE, "/job/train.py:10"),
    # The user's call into torch: the user's frame, the user's class.
    (("/job/train.py", TORCH_DIR / "nn" / "module.py"), "TypeError: bad argument",
     FailureClass.USER_CODE, "/job/train.py:10"),
    # Collective wrappers and worker bootstraps only pass the call through.
    (("/job/train.py", ELASTICFT_DIR / "diag" / "recorder.py", TORCH_DIR / "distributed.py"),
     "TypeError: bad tensor", FailureClass.USER_CODE, "/job/train.py:10"),
    ((ELASTICFT_DIR / "agent" / "warm_bootstrap" / "sitecustomize.py", "/job/train.py"),
     "RuntimeError: boom", FailureClass.UNKNOWN, "/job/train.py:11"),
    # The standard library and frozen modules are tools, python -c is the user's.
    (("<frozen runpy>", "/job/train.py", Path(json.__file__)), "ValueError: bad json",
     FailureClass.USER_CODE, "/job/train.py:11"),
    (("<string>",), "RuntimeError: boom", FailureClass.UNKNOWN, "<string>:10"),
    ((TORCH_DIR / "a.py",), "RuntimeError: boom", FailureClass.UNKNOWN, None),
])
def test_whose_code_raised(frames: tuple[Path | str, ...], error: str, cls: FailureClass,
                           user_frame: str | None, tmp_path: Path) -> None:
    record = classify_exit(0, 0, 1, 1, stderr_file=stderr_file(
        tmp_path, traceback_through(*frames, error=error)))
    assert record.failure_class is cls
    assert (record.user_frame or "").startswith(user_frame or "") and \
        (record.user_frame is None) == (user_frame is None)
    assert record.location is not None and record.location.startswith(str(frames[-1]))
    if record.user_frame and record.user_frame != record.location:
        assert f"(called from {record.user_frame})" in record.summary()


def test_a_checkpoint_that_does_not_fit_the_model_is_the_users_launch() -> None:
    text = ('Traceback (most recent call last):\n'
            '  File "/job/train.py", line 94, in main\n'
            '    ckpt.restore(model, optim)\n'
            f'  File "{Path(elasticft.__file__).parent / "ckpt" / "checkpointer.py"}", line 3, '
            'in restore\n'
            "elasticft.ckpt.api.StateMismatch: run r: cannot restore the checkpoint of step 6 "
            "(/c) into this model: checkpoint item 'model.pos' is ...; start this run over with "
            "elasticft-run --fresh\n")
    info = parse_traceback(text)
    assert info is not None and info.type_name == "StateMismatch"
    assert info.message.startswith("run r: cannot restore")
    # Raised in elasticft's restore, yet no fault of elasticft's: the launch must change.
    assert classify_exception(info) is FailureClass.USER_CODE
