"""The CUDA graphs a survivor drops as soon as its training call failed
(``inprocess.cuda_graphs``): what runs, in what order, and what a failing dropper leaves. The
order against the abort, on a real group: tests/inprocess/test_interrupt_windows.py."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from elasticft.inprocess import cuda_graphs


def _torch(cuda_initialized: bool) -> SimpleNamespace:
    return SimpleNamespace(cuda=SimpleNamespace(is_initialized=lambda: cuda_initialized))


@pytest.mark.parametrize(("trees_loaded", "cuda_initialized", "reset"), [
    (True, True, True),
    (True, False, False),  # a CPU process: no graph was captured
    (False, True, False),  # torch.compile's graph trees never loaded
])
def test_the_registered_droppers_run_then_torch_compiles_graph_trees_where_they_exist(
        trees_loaded: bool, cuda_initialized: bool, reset: bool) -> None:
    ran: list[str] = []
    trees = SimpleNamespace(reset_cudagraph_trees=lambda: ran.append("trees"))
    modules = {"torch": _torch(cuda_initialized),
               **({cuda_graphs.COMPILE_TREES: trees} if trees_loaded else {})}

    def failing() -> None:
        ran.append("failing")
        raise RuntimeError("graph already destroyed")

    undo = [cuda_graphs.drop_on_failure(failing, "failing"),
            cuda_graphs.drop_on_failure(lambda: ran.append("script"), "script's graphs")]
    try:
        names = cuda_graphs.drop_all(modules)
    finally:
        for remove in undo:
            remove()
    assert ran == ["failing", "script", *(["trees"] if reset else [])]
    assert names == ["script's graphs",
                     *(["torch.compile's CUDA graph trees"] if reset else [])]
    assert cuda_graphs.drop_all(modules) == (
        ["torch.compile's CUDA graph trees"] if reset else [])  # unregistered
