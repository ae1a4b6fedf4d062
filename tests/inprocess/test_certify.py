"""The certified restore (:mod:`elasticft.inprocess.certify`): the digest of a state, the
comparison of the replicas' rows by a table, and the optimizer state it reads. End to end (a
replacement that restored a flipped bit, every worker restarted) in test_inprocess.py."""

from __future__ import annotations

import pytest
import torch

from elasticft.inprocess.certify import differing, digest, state_tensors


def test_a_digest_changes_with_any_bit_and_not_with_a_copy() -> None:
    torch.manual_seed(0)
    tensors = [torch.randn(5, 3), torch.randn(7, dtype=torch.float64),
               torch.randn(4).to(torch.bfloat16), torch.arange(3, dtype=torch.int64)]
    same = digest([t.clone() for t in tensors])
    assert digest(tensors) == same and same[0] == 4
    for index in range(len(tensors)):
        changed = [t.clone() for t in tensors]
        flat = changed[index].view(-1)
        bits = flat.view({2: torch.int16, 4: torch.int32, 8: torch.int64}[flat.element_size()])
        bits[0] ^= 1
        assert digest(changed) != same, index
    assert digest([torch.empty(0)]) == (0, 0)


ROW = [3, 1234, 1, 5, 99]


@pytest.mark.parametrize(("rows", "bad"), [
    ([ROW, ROW, ROW], []),
    ([ROW, [3, 1235, 1, 5, 99], ROW], [1]),                    # a parameter differs
    ([ROW, ROW, [3, 1234, 1, 5, 98]], [2]),                    # the optimizer state differs
    ([ROW, [3, 1234, 0, 2, 7], ROW], []),                      # a sharded optimizer's state
    ([[3, 1234, 0, 2, 7], [3, 1234, 0, 3, 8]], []),            # incomplete everywhere
    ([[3, 1234, 0, 2, 7], [4, 1234, 0, 3, 8]], [1]),           # another parameter count
    ([], []),
], ids=["equal", "parameter", "state", "sharded-state", "no-state", "count", "none"])
def test_which_replicas_differ_from_the_first(rows: list[list[int]], bad: list[int]) -> None:
    assert differing(rows) == bad


def test_the_optimizer_state_of_the_parameters_and_whether_it_is_complete() -> None:
    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.AdamW(model.parameters())
    parameters = list(model.parameters())
    assert state_tensors([optimizer], parameters) == (False, [])  # no step taken yet
    model(torch.ones(1, 3)).sum().backward()
    optimizer.step()
    complete, tensors = state_tensors([optimizer], parameters)
    assert complete and len(tensors) == 3 * len(parameters)  # exp_avg, exp_avg_sq, step
