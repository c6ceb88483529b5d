"""Direct block calls: a settled block runs the graph its arguments select, past Dynamo.

Real ``nn.Module.compile`` with a counting backend (each graph Dynamo hands
it is recorded with the shapes it was traced for), so a test sees *which*
compiled graph ran on each call, and that one ran at all rather than the
eager ``forward``. The engine-level check (same tokens with and without,
direct calls taken) is in the repository's ``tests/test_compile_granularity.py``.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from torch import nn

from spyre_inference.platform import direct_block_calls as dbc


class _Block(nn.Module):
    """Like a decoder layer: the first one gets ``residual=None`` (a second graph)."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 8)

    def forward(
        self, hidden: torch.Tensor, residual: torch.Tensor | None = None, scale: float = 1.0
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            residual = hidden
        else:
            hidden = hidden + residual
            residual = hidden
        return self.proj(hidden) * scale, residual


class _Graphs:
    """A Dynamo backend that runs each graph as traced and logs which one ran."""

    def __init__(self) -> None:
        self.compiled: list[tuple] = []
        self.ran: list[tuple] = []

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: list) -> object:
        tag = tuple(tuple(x.shape) if isinstance(x, torch.Tensor) else x for x in example_inputs)
        self.compiled.append(tag)

        def run(*args):
            self.ran.append(tag)
            return gm.forward(*args)

        return run


@pytest.fixture
def blocks() -> Iterator[tuple[list[_Block], _Graphs]]:
    torch._dynamo.reset()
    torch.manual_seed(0)
    graphs = _Graphs()
    stack = [_Block(), _Block()]
    for block in stack:
        block.compile(backend=graphs, fullgraph=True, dynamic=False)
        assert dbc.install(block)
    yield stack, graphs
    torch._dynamo.reset()


def _layers(stack: list[_Block], n: int, scale: float = 1.0) -> torch.Tensor:
    hidden = torch.arange(n * 8, dtype=torch.float32).reshape(n, 8) / 10
    residual = None
    for block in stack:
        hidden, residual = block(hidden, residual, scale)
    return hidden + residual


def _eager(stack: list[_Block], n: int, scale: float = 1.0) -> torch.Tensor:
    hidden = torch.arange(n * 8, dtype=torch.float32).reshape(n, 8) / 10
    residual = None
    for block in stack:
        hidden, residual = block.forward(hidden, residual, scale)
    return hidden + residual


def test_settled_calls_run_the_graph_their_arguments_select(blocks) -> None:
    stack, graphs = blocks
    for n in (4, 8):  # warm-up: outside direct_calls, through Dynamo
        _layers(stack, n)
    assert len(graphs.compiled) == 4  # (residual None, tensor) x (4, 8)
    before = dbc.stats().snapshot()
    graphs.ran.clear()
    with dbc.direct_calls():
        outs = {n: [_layers(stack, n) for _ in range(3)] for n in (8, 4)}
    after = dbc.stats().snapshot()
    assert after["direct"] - before["direct"] == 12  # 2 sizes x 3 steps x 2 blocks
    assert after["resolved"] - before["resolved"] == 4  # one per (block, signature)
    assert after["refused"] == before["refused"]
    assert len(graphs.compiled) == 4, "no graph compiled"
    # Every call ran a compiled graph, the one traced for its shapes and variant.
    assert len(graphs.ran) == 12
    first, second = graphs.compiled[0], graphs.compiled[1]
    assert graphs.ran[:2] == [graphs.compiled[2], graphs.compiled[3]]  # 8 tokens
    assert graphs.ran[6:8] == [first, second]  # 4 tokens
    for n, results in outs.items():
        for out in results:
            torch.testing.assert_close(out, _eager(stack, n), rtol=0, atol=0)


def test_a_new_scalar_value_is_a_new_signature(blocks) -> None:
    """Dynamo specializes on ``scale``: a value warm-up did not see stays on torch.compile."""
    stack, _ = blocks
    _layers(stack, 4)
    before = dbc.stats().snapshot()
    with dbc.direct_calls():
        out = _layers(stack, 4, scale=0.5)  # no cached graph passes: Dynamo compiles
    after = dbc.stats().snapshot()
    assert after["refused"] - before["refused"] == 2
    assert after["direct"] == before["direct"]
    torch.testing.assert_close(out, _eager(stack, 4, 0.5), rtol=0, atol=0)
    # The signature keeps the ordinary call (which now hits the new graph).
    with dbc.direct_calls():
        _layers(stack, 4, scale=0.5)
    assert dbc.stats().direct == after["direct"]


def test_outside_the_context_calls_go_through_dynamo(blocks) -> None:
    stack, _ = blocks
    _layers(stack, 4)
    before = dbc.stats().snapshot()
    _layers(stack, 4)
    assert dbc.stats().snapshot() == before


def test_hooks_and_unkeyable_arguments_keep_the_ordinary_call(blocks) -> None:
    stack, _ = blocks
    _layers(stack, 4)
    seen: list[int] = []
    handle = stack[0].register_forward_pre_hook(lambda *_: seen.append(1))
    before = dbc.stats().snapshot()
    with dbc.direct_calls():
        _layers(stack, 4)
    handle.remove()
    assert seen == [1], "the hook ran"
    assert dbc.stats().direct - before["direct"] == 1  # only the hook-free block
    # A tensor subclass cannot be keyed (its own state may be guarded).
    sub = torch.ones(4, 8).as_subclass(_Marked)
    before = dbc.stats().snapshot()
    with dbc.direct_calls():
        out, _ = stack[1](sub, torch.ones(4, 8), 1.0)
    assert dbc.stats().snapshot() == before
    torch.testing.assert_close(out, stack[1].forward(torch.ones(4, 8), torch.ones(4, 8))[0])


class _Marked(torch.Tensor):
    pass


def test_install_needs_a_compiled_block() -> None:
    block = _Block()
    assert not dbc.install(block)
    block.compile(backend="eager")
    assert dbc.install(block)
    assert not dbc.install(block)
