"""elasticft's log lines have torch's shape (glog's), so the launcher's output reads as one log."""

from __future__ import annotations

import logging
import re
import sys

import pytest

from elasticft import logs

pytestmark = pytest.mark.timeout(30)

GLOG = re.compile(r"[VIWEC]\d{4} \d\d:\d\d:\d\d\.\d{6} \d+ [\w./-]+\.py:\d+\] ")
"""torch's prefix: level letter, month and day, time to the microsecond, pid, source:line."""


@pytest.mark.parametrize(
    ("pathname", "roots", "shown"),
    [
        ("/w/main/elasticft/agent/agent.py", ["/w/main"], "elasticft/agent/agent.py"),
        ("/w/main/elasticft/agent/agent.py", [], "elasticft/agent/agent.py"),  # its logger
        ("/w/main/elasticft/ckpt/__init__.py", [], "elasticft/ckpt/__init__.py"),
        ("/v/site-packages/torch/distributed/run.py", ["/v", "/v/site-packages"],
         "torch/distributed/run.py"),
        ("/elsewhere/x.py", ["/w/main"], "/elsewhere/x.py"),
        ("/w/mainly/x.py", ["/w/main"], "/w/mainly/x.py"),
        ("/w/main/x.py", ["", "/w/main/"], "x.py"),
    ],
)
def test_the_source_is_shown_as_an_import_names_it(pathname: str, roots: list[str],
                                                    shown: str) -> None:
    name = "elasticft.ckpt" if "__init__" in pathname else "elasticft.agent.agent"
    assert logs.source_path(pathname, roots, logger=name) == shown


def record(level: int, message: str, exc: bool = False) -> logging.LogRecord:
    info = None
    if exc:
        try:
            raise ValueError("boom")
        except ValueError:
            info = sys.exc_info()
    return logging.LogRecord("elasticft.logs", level, logs.__file__, 42, message, (), info)


@pytest.mark.parametrize(("level", "letter"), [(logging.DEBUG, "V"), (logging.INFO, "I"),
                                               (logging.WARNING, "W"), (logging.ERROR, "E")])
def test_a_line_has_torchs_prefix(level: int, letter: str) -> None:
    line = logs.GlogFormatter().format(record(level, "worker failure: rank 1"))
    assert GLOG.match(line) and line.startswith(letter), line
    assert line.endswith("elasticft/logs.py:42] worker failure: rank 1"), line


def test_every_line_of_a_message_and_its_traceback_gets_the_prefix() -> None:
    text = logs.GlogFormatter().format(record(logging.ERROR, "two\nlines", exc=True))
    lines = text.splitlines()
    assert len(lines) >= 5 and all(GLOG.match(line) for line in lines), text
    assert lines[-1].endswith("] ValueError: boom"), text


def test_the_shape_is_torchs_own() -> None:
    """The same record through torch's formatter (what torch's elastic lines use) and ours:
    the same prefix up to the source, which each writes relative to its sys.path entry."""
    from torch._logging._internal import TorchLogsFormatter

    one = record(logging.WARNING, "hello")
    theirs, ours = TorchLogsFormatter().format(one), logs.GlogFormatter().format(one)
    assert GLOG.match(theirs), theirs
    assert theirs.split(" ")[:3] == ours.split(" ")[:3] and theirs.endswith("] hello")
