"""The torchtitan integration's decisions, which need no torchtitan: the config key that turns
it on, the rules its trainer must keep (a table), the position carried in a snapshot's
extras, and the one line a user without torchtitan gets. torchtitan's trainer itself does not
train on a CPU (docs/frameworks/torchtitan.md): its run is the GPU command
``bash bench/gpu_check.sh --parts torchtitan``."""

from __future__ import annotations

import importlib
import json
import pickle
import sys

import pytest

from elasticft.extras import MissingExtra
from elasticft.integrations.torchtitan_checks import (
    ENABLE_TARGET,
    TrainerFacts,
    decode_position,
    enabled,
    encode_position,
    trainer_problems,
)


@pytest.mark.parametrize(("imports", "expected"), [
    ([], False),
    ([ENABLE_TARGET], True),
    (["torchtitan.overrides.moe_token_dispatcher.hybridep_override", ENABLE_TARGET], True),
    ([(ENABLE_TARGET, {})], True),  # a target with arguments
    (["elasticft.integrations.torchtitan"], False),  # the module, not its override
    ([("my_pkg.triton_rope.triton_rope", {"block_size": 256})], False),
], ids=["none", "alone", "among-others", "with-kwargs", "module-only", "another"])
def test_enabled_by_the_one_override_target(imports: list, expected: bool) -> None:
    assert enabled(imports) is expected


@pytest.mark.parametrize(("facts", "expected"), [
    (TrainerFacts(model_parts=1, optimizers=1, seed=42), []),
    (TrainerFacts(model_parts=2, optimizers=2, seed=42),
     ["keeps one model part, not 2: drop elasticft.integrations.torchtitan.inprocess"]),
    (TrainerFacts(model_parts=1, optimizers=2, seed=42), ["restores one optimizer, not 2"]),
    (TrainerFacts(model_parts=1, optimizers=1, seed=None), ["set debug.seed"]),
    (TrainerFacts(1, 1, 0, checkpoint_manager="S3CheckpointManager"),
     ["extends its CheckpointManager, not S3CheckpointManager"]),
    (TrainerFacts(3, 3, None, "Other"), ["not Other", "under pipeline parallelism", "debug.seed"]),
], ids=["fits", "pipeline", "optimizers", "no-seed", "other-manager", "all"])
def test_trainer_problems(facts: TrainerFacts, expected: list[str]) -> None:
    problems = trainer_problems(facts)
    assert len(problems) == len(expected), problems
    for problem, words in zip(problems, expected, strict=True):
        assert words in problem and "\n" not in problem


@pytest.mark.parametrize("dataloader", [
    None,
    {"dp_rank_0": pickle.dumps({"_snapshot": {"_num_yielded": 7}}), "world_size": 2},
], ids=["no-loader", "pickled-bytes"])
def test_the_position_goes_through_a_snapshots_json_extras(dataloader: dict | None) -> None:
    extras = encode_position({"step": 12, "ntokens_seen": 3072}, {"last_epoch": 12}, dataloader)
    assert json.loads(json.dumps(extras)) == extras  # JSON values only
    assert decode_position(extras) == ({"step": 12, "ntokens_seen": 3072}, {"last_epoch": 12},
                                       dataloader)


def test_without_torchtitan_the_integration_is_one_line_naming_the_extra(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "torchtitan", None)  # import fails as if not installed
    monkeypatch.delitem(sys.modules, "elasticft.integrations.torchtitan", raising=False)
    with pytest.raises(MissingExtra) as raised:
        importlib.import_module("elasticft.integrations.torchtitan")
    said = str(raised.value)
    assert said.startswith("in-process recovery for torchtitan needs torchtitan: "
                           "pip install 'elasticft[torchtitan]' (it needs a torch with CUDA")
    assert "\n" not in said
