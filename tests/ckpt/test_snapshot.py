"""State layout: DCP names, JSON leaves without pickle, exact round trips."""

from __future__ import annotations

import math

import pytest
import torch
from torch.distributed.checkpoint.state_dict import get_state_dict

from elasticft.ckpt.api import UnsupportedState
from elasticft.ckpt.snapshot import Flattener, flatten, tensor_view, unflatten
from tests.ckpt.helpers import trained_model


def _materialize(layout) -> bytearray:
    payload = bytearray(layout.payload_bytes)
    for entry in layout.tensors:
        tensor_view(payload, entry.to_json()).copy_(entry.tensor)
    return payload


@pytest.mark.timeout(60)
def test_round_trip_keeps_tensors_tuples_and_special_floats() -> None:
    model, optim = trained_model()
    model_sd, optim_sd = get_state_dict(model, optim)
    state = {"model": model_sd, "optim": optim_sd,
             "extra": {"pos": (3, [1, 2]), "best": math.inf, "name": "x", "none": None}}
    layout = flatten(state)
    fqns = {t.fqn for t in layout.tensors}
    assert "model.0.weight" in fqns and "optim.state.0.weight.exp_avg" in fqns
    back = unflatten(layout.manifest(7, 0, 1), _materialize(layout), copy=True)
    assert torch.equal(back["model"]["2.bias"], model_sd["2.bias"])
    assert torch.equal(back["optim"]["state"]["0.weight"]["exp_avg_sq"],
                       optim_sd["state"]["0.weight"]["exp_avg_sq"])
    assert back["optim"]["param_groups"][0]["betas"] == (0.9, 0.999)
    assert back["extra"] == {"pos": (3, [1, 2]), "best": math.inf, "name": "x", "none": None}


@pytest.mark.timeout(30)
def test_unsupported_value_is_named() -> None:
    with pytest.raises(UnsupportedState, match=r"extra\.fn.*JSON"):
        flatten({"extra": {"fn": object()}})


@pytest.mark.timeout(30)
def test_flattener_reuses_placement_only_while_structure_holds() -> None:
    model, _optim = trained_model()
    flattener = Flattener()
    first = flattener({"model": model.state_dict()})
    again = flattener({"model": model.state_dict()})
    assert [(t.fqn, t.offset) for t in again.tensors] == [(t.fqn, t.offset) for t in first.tensors]
    assert again.tensors[0].tensor.data_ptr() == model.state_dict()["0.weight"].data_ptr()
    grown = flattener({"model": model.state_dict(), "more": torch.zeros(1000)})
    assert grown.payload_bytes > first.payload_bytes
    assert "more" in {t.fqn for t in grown.tensors}


def test_state_capture_keeps_its_rng_tensors_and_their_current_values() -> None:
    from elasticft.ckpt import StateCapture

    model = torch.nn.Linear(2, 2)
    snap = StateCapture(model)
    first = snap()["rng"]["torch"]
    torch.rand(3)  # advances the generator
    second = snap()["rng"]["torch"]
    assert second is first  # the save then takes its unchanged-state path
    assert torch.equal(second, torch.get_rng_state())


def test_python_rng_words_are_a_tensor_that_follows_random_and_restores_it() -> None:
    import random

    from elasticft.ckpt import StateCapture
    from elasticft.ckpt.restoring.state import set_rng_state

    snap = StateCapture(torch.nn.Linear(2, 2))
    first = snap()["rng"]["python"]["state"]
    assert isinstance(first, torch.Tensor) and first.dtype == torch.int64
    random.random()
    saved = {k: v.clone() if isinstance(v, torch.Tensor) else v
             for k, v in snap()["rng"]["python"].items()}
    assert saved["state"].tolist() == list(random.getstate()[1])
    assert snap()["rng"]["python"]["state"] is first  # the same object, refreshed in place
    expected = [random.random() for _ in range(3)]
    set_rng_state({"python": saved})
    assert [random.random() for _ in range(3)] == expected
    # Snapshots written before the words were a tensor hold a list of ints.
    set_rng_state({"python": dict(saved, state=saved["state"].tolist())})
    assert [random.random() for _ in range(3)] == expected


def test_state_capture_rebuilds_when_the_module_tree_changes() -> None:
    from elasticft.ckpt import StateCapture

    model = torch.nn.Sequential(torch.nn.Linear(2, 2))
    snap = StateCapture(model)
    assert snap()["model"] is snap()["model"]  # unchanged: the same state dict
    model[0].weight = torch.nn.Parameter(torch.ones(2, 2))  # a parameter replaced
    assert torch.equal(snap()["model"]["0.weight"], torch.ones(2, 2))
    model.append(torch.nn.Linear(2, 3))  # a submodule added after the capture was made
    assert snap()["model"]["1.weight"].shape == (3, 2)
    model[1].add_module("inner", torch.nn.Linear(3, 1))  # deeper, in the new submodule
    assert "1.inner.weight" in snap()["model"]


def test_manifest_text_reuses_unchanged_int_lists_and_matches_a_full_encoding() -> None:
    import random

    from elasticft.ckpt import StateCapture
    from elasticft.ckpt.snapshot import manifest_bytes

    model = torch.nn.Linear(2, 2)
    snap, flattener = StateCapture(model), Flattener()
    for step in range(5):
        if step == 3:
            random.random()  # Python's RNG state (625 ints) changes
        # The same numbers first as ints, then as floats: equal in Python, not in JSON.
        numbers = list(range(20)) if step < 4 else [float(n) for n in range(20)]
        layout = flattener(snap(extra={"step": step, "numbers": numbers}))
        manifest = layout.manifest(step, 0, 1)
        assert layout.manifest_bytes(step, 0, 1) == manifest_bytes(manifest)
    assert manifest_bytes(manifest).count(b'"value":[0.0,1.0') == 1


def test_a_model_without_an_optimizer_round_trips() -> None:
    from elasticft.ckpt.restoring.state import capture, restore

    model, other = torch.nn.Linear(3, 2), torch.nn.Linear(3, 2)
    state = capture(model, extra={"step": 4})
    assert set(state["model"]) == {"weight", "bias"}
    layout = flatten(state)
    loaded = unflatten(layout.manifest(0, 0, 1), _materialize(layout), copy=True)
    assert restore(loaded, other) == {"step": 4}
    assert torch.equal(other.weight, model.weight)

