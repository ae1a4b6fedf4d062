"""bench/inprocess_repeat.py without its jobs (the suite's across-nodes tests run one of each):
a fault it does not know is a usage error naming the choices, and a run that differs is told
by its first step that differs."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.conftest import ROOT

sys.path.insert(0, str(ROOT / "bench"))
try:
    from inprocess_repeat import first_difference
finally:
    sys.path.remove(str(ROOT / "bench"))


@pytest.mark.timeout(60)
def test_an_unknown_fault_is_a_usage_error_that_names_the_choices() -> None:
    done = subprocess.run([sys.executable, str(ROOT / "bench" / "inprocess_repeat.py"),
                           "--faults", "mid-save,bogus"], capture_output=True, text=True,
                          timeout=50)
    assert done.returncode == 2
    assert "unknown --faults ['bogus']; choose from after-save, before-save, mid-save" in \
        done.stderr


@pytest.mark.parametrize(("losses", "said"), [
    ({1: "2.5", 2: "2.25", 3: "2.0"}, "step 2: 2.25 against 2.125"),
    ({1: "2.5"}, "step 2: None against 2.125"),
    ({1: "2.5", 2: "2.125", 3: "2.0", 4: "1.5"}, "every step equal, more steps logged"),
])
def test_a_run_that_differs_is_told_by_its_first_step_that_differs(
        losses: dict[int, str], said: str) -> None:
    assert first_difference(losses, {1: "2.5", 2: "2.125", 3: "2.0"}) == said
