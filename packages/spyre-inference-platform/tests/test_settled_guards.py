"""Settled guards: when a step may skip Dynamo's guard checks, on a real compiled module.

The module is compiled with ``torch.compile`` (``backend="eager"``: guards and
Dynamo's cache are what is under test, not Inductor's code) and called through
the same ``_SpyreModelWrapper`` the runner uses. The engine-level check (same
results with and without, every bucket settles) is in the repository's
``tests/test_compile_granularity.py``.
"""

from __future__ import annotations

import logging

import pytest
import torch
from torch import nn

from spyre_inference.platform.model_wrapper import _SpyreModelWrapper


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 8)

    def forward(self, positions: torch.Tensor) -> torch.Tensor:
        return self.proj(positions.reshape(-1, 1).expand(-1, 8))


class _Tiny(nn.Module):
    """Like the runner's models: the top level runs eagerly, its block is compiled."""

    def __init__(self) -> None:
        super().__init__()
        self.block = _Block()

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.block(positions)


def _graphs(fn) -> int:
    from torch._C._dynamo.eval_frame import _debug_get_cache_entry_list

    return len(_debug_get_cache_entry_list(fn.__code__))


@pytest.fixture
def wrapper():
    torch._dynamo.reset()
    model = _Tiny()
    model.block.compile(backend="eager", dynamic=False)
    wrapper = _SpyreModelWrapper(model)
    stances: list[bool] = []
    model.register_forward_pre_hook(
        lambda *_: stances.append(torch._dynamo.eval_frame._is_skip_guard_eval_unsafe_stance())
    )
    yield wrapper, (lambda: _graphs(_Block.forward)), stances
    torch._dynamo.reset()


def _step(wrapper: _SpyreModelWrapper, n: int) -> torch.Tensor:
    ids = torch.zeros(n, dtype=torch.int32)
    return wrapper(input_ids=ids, positions=torch.arange(n, dtype=torch.float32))


def test_a_bucket_settles_after_one_full_guard_step(wrapper) -> None:
    wrapper, graphs, stances = wrapper
    for n in (4, 8):  # warm-up
        _step(wrapper, n)
    assert not stances[-1]
    wrapper.guards.arm((4, 8), graphs)
    before = graphs()
    outs = [_step(wrapper, n) for n in (4, 4, 8, 4, 8)]
    assert stances[2:] == [False, True, False, True, True]
    assert wrapper.guards.settled == {4, 8}
    assert graphs() == before
    torch.testing.assert_close(outs[0], outs[1], rtol=0, atol=0)
    torch.testing.assert_close(outs[2], outs[4], rtol=0, atol=0)
    # Lean steps still tell the buckets' graphs apart.
    assert outs[1].shape == (4, 8) and outs[4].shape == (8, 8)


def test_a_bucket_that_compiles_when_served_keeps_full_guards(wrapper, caplog) -> None:
    wrapper, graphs, stances = wrapper
    _step(wrapper, 4)  # warm-up compiled 4 only
    wrapper.guards.arm((4, 8), graphs)
    with caplog.at_level(logging.WARNING):
        _step(wrapper, 8)  # compiles: warm-up missed it
    assert "compiled a new graph after warm-up" in caplog.text
    for n in (8, 8, 4, 4):
        _step(wrapper, n)
    assert wrapper.guards.settled == {4}
    assert stances[1:] == [False, False, False, False, True]


def test_sizes_warm_up_did_not_compile_keep_full_guards(wrapper) -> None:
    wrapper, graphs, stances = wrapper
    _step(wrapper, 4)
    wrapper.guards.arm((4,), graphs)
    for n in (4, 4, 6, 6):
        _step(wrapper, n)
    assert stances[1:] == [False, True, False, False]
    assert wrapper.guards.settled == {4}


def test_a_settled_bucket_that_needs_a_new_graph_reruns_with_full_guards(wrapper, caplog) -> None:
    """Dynamo refuses to compile under the lean stance; the step is run again, not lost."""
    wrapper, graphs, stances = wrapper
    for n in (4, 8):
        _step(wrapper, n)
    wrapper.guards.arm((4, 8), graphs)
    for n in (4, 8):
        _step(wrapper, n)
    assert wrapper.guards.settled == {4, 8}
    # 4 tokens again, but positions of another rank (as M-RoPE's [3, n]): no
    # cached graph passes the shape guards that tell 4 from 8.
    positions = torch.arange(8, dtype=torch.float32).reshape(2, 4)
    with caplog.at_level(logging.WARNING):
        out = wrapper(input_ids=torch.zeros(4, dtype=torch.int32), positions=positions)
    assert "needed a graph warm-up did not compile" in caplog.text
    eager = wrapper.model.block.proj(positions.reshape(-1, 1).expand(-1, 8))
    torch.testing.assert_close(out, eager)
    assert wrapper.guards.settled == {8}
    # The lean attempt, then the full-guard rerun.
    assert stances[-2:] == [True, False]
