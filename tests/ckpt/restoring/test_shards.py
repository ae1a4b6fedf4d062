"""A snapshot item that does not fit the live tensor it is restored into is one
:class:`StateMismatch` naming the tensor, both layouts and the likely cause (plain tensors here;
the sharding table, ``test_sharding.py``, runs DTensors on real ranks)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from elasticft.ckpt import StateMismatch, restore
from elasticft.ckpt.restoring.shards import into_live, mismatch


def _item(shape: list[int], global_size: list[int], sharding: Any = None) -> dict[str, Any]:
    item: dict[str, Any] = {"shape": shape, "global_size": global_size}
    if sharding is not None:
        item["sharding"] = sharding
    return item


SHARD = {"mesh": [2], "placements": ["S(0)"]}

CASES = [
    # (saved item, live shape, None or words the message must hold)
    (_item([4, 3], [4, 3]), [4, 3], None),
    (_item([4, 3], [4, 3], {"mesh": [1], "placements": ["S(0)"]}), [4, 3], None),
    (_item([2, 3], [4, 3], SHARD), [4, 3],
     ["a shard of shape [2, 3] of a [4, 3] tensor (placements ['S(0)'] on a mesh of [2])",
      "the live one is a whole tensor of shape [4, 3]", "the model is not sharded"]),
    (_item([4, 3], [4, 3]), [5, 3],
     ["a whole tensor of shape [4, 3]", "the live one is a whole tensor of shape [5, 3]",
      "another model"]),
    (_item([2, 3], [4, 3], SHARD), [8, 3], ["another model"]),
]


@pytest.mark.timeout(30)
@pytest.mark.parametrize(("item", "live_shape", "words"), CASES)
def test_an_item_that_does_not_fit_is_named_with_both_layouts_and_the_cause(
    item: dict[str, Any], live_shape: list[int], words: list[str] | None
) -> None:
    error = mismatch("model.w", item, torch.zeros(live_shape))
    if words is None:
        assert error is None
        return
    assert isinstance(error, StateMismatch) and error.reason == "state_mismatch"
    text = str(error)
    assert text.startswith("checkpoint item 'model.w' is ") and "\n" not in text
    for word in words:
        assert word in text, text


@pytest.mark.timeout(30)
def test_a_plain_tensor_of_another_shape_is_refused_before_torch_sees_it() -> None:
    with pytest.raises(StateMismatch, match=r"'model\.w' has shape \[2, 3\].*another model"):
        into_live("model.w", torch.zeros(2, 3), torch.zeros(4, 3))
    assert into_live("model.w", torch.ones(4, 3), torch.zeros(4, 3)).sum() == 12


@pytest.mark.timeout(30)
def test_restoring_another_model_raises_elasticfts_error_not_torchs() -> None:
    saved = {"model": {"0.weight": torch.zeros(2, 8), "0.bias": torch.zeros(2)}, "extra": {}}
    with pytest.raises(StateMismatch, match=r"'model\.0\.weight'"):
        restore(saved, torch.nn.Sequential(torch.nn.Linear(8, 4)))
