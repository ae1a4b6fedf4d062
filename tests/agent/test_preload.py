"""The frameworks the warm template imports for a script: its top-level imports of them, as
it names them, with a condition on its command line decided (pure)."""

from __future__ import annotations

import pytest

from elasticft.agent.preload import framework_imports, script_command

LIGHTNING_EITHER = """
import sys
if "--pytorch-lightning" in sys.argv:
    import pytorch_lightning as L
else:
    import lightning.pytorch as L
"""


@pytest.mark.parametrize(("source", "script_argv", "expected"), [
    ("import lightning as L\nimport torch\n", ["t.py"], ("lightning",)),
    ("from transformers import Trainer, TrainingArguments\n", ["t.py"],
     ("transformers:Trainer", "transformers:TrainingArguments")),
    ("from elasticft.integrations.hf import train\nfrom elasticft import launch\n", ["t.py"],
     ("elasticft.integrations.hf:train",)),
    (LIGHTNING_EITHER, ["t.py"], ("lightning.pytorch",)),
    (LIGHTNING_EITHER, ["t.py", "--pytorch-lightning"], ("pytorch_lightning",)),
    # an import the script may not reach, or reaches later, is the worker's own
    ("def main():\n    import lightning\n", ["t.py"], ()),
    ("import os\nif os.environ.get('X'):\n    import lightning\n", ["t.py"], ()),
    ("import lightning, lightning\nfrom transformers import *\n", ["t.py"], ("lightning",)),
    ("try:\n    import accelerate\nexcept ImportError:\n    pass\n", ["t.py"], ("accelerate",)),
    ("from . import lightning\nimport lightningx\n", ["t.py"], ()),
    ("this is not python (\n", ["t.py"], ()),
])
def test_a_scripts_framework_imports(source: str, script_argv: list[str],
                                     expected: tuple[str, ...]) -> None:
    assert framework_imports(source, script_argv) == expected


@pytest.mark.parametrize(("argv", "expected"), [
    (["python", "-u", "train.py", "--x", "1"], ["train.py", "--x", "1"]),
    (["python", "-W", "ignore", "-X", "dev", "train.py"], ["train.py"]),
    (["python", "-m", "pkg.train", "train.py"], None),
    (["python", "-c", "pass"], None),
    (["python", "-u"], None),
])
def test_the_script_a_command_runs(argv: list[str], expected: list[str] | None) -> None:
    assert script_command(argv) == expected
