"""``SpyreCommunicator`` against torch.distributed on gloo, with two real ranks.

Every check runs in both ranks of a TP=2 vLLM distributed environment (see
``rank_pair.py``): the TP group's communicator is the one the installed
platform names, reached through the comms package's entry point, exactly as in
an engine. References are independent of the code under test: the exact sum or
concatenation of both ranks' inputs (regenerated here from their seeds), and
torch.distributed's own in-place ``all_reduce`` / tensor-form
``all_gather_into_tensor`` on the same gloo group.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist

from spyre_inference.comms import REDUCE_SCATTER_UNSUPPORTED, SpyreCommunicator
from spyre_inference.comms.communicator import device_backend_map

DTYPES = [torch.bfloat16, torch.float16, torch.float32]
WORLD = 2


def make_input(shape: tuple[int, ...], dtype: torch.dtype, seed: int, rank: int) -> torch.Tensor:
    """Rank ``rank``'s input: drawn in float32, then rounded once to ``dtype``."""
    gen = torch.Generator().manual_seed(1000 * seed + rank)
    return torch.randn(shape, generator=gen).to(dtype)


def all_inputs(shape: tuple[int, ...], dtype: torch.dtype, seed: int) -> list[torch.Tensor]:
    return [make_input(shape, dtype, seed, rank) for rank in range(WORLD)]


# ---- functions run on every rank --------------------------------------------


def rank_describe() -> dict[str, Any]:
    from vllm.distributed import get_tp_group, get_world_group

    tp = get_tp_group()
    comm = tp.device_communicator
    return {
        "class": f"{type(comm).__module__}.{type(comm).__qualname__}",
        "is_spyre_communicator": isinstance(comm, SpyreCommunicator),
        "rank_in_group": comm.rank_in_group,
        "world_size": comm.world_size,
        "device_backend": str(dist.get_backend(comm.device_group)),
        "host_is_device_group": comm.host_group is comm.device_group,
        "world_communicator": get_world_group().device_communicator,
    }


def rank_all_reduce(shape: tuple[int, ...], dtype: torch.dtype, seed: int) -> dict[str, Any]:
    from vllm.distributed import get_tp_group, tensor_model_parallel_all_reduce

    tp = get_tp_group()
    x = make_input(shape, dtype, seed, tp.rank_in_group)
    before = x.clone()
    out = tp.device_communicator.all_reduce(x)
    via_coordinator = tensor_model_parallel_all_reduce(x)
    reference = x.clone()
    dist.all_reduce(reference, group=tp.device_group)
    return {
        "out": out,
        "via_coordinator": via_coordinator,
        "reference": reference,
        "input_unchanged": torch.equal(x, before),
        "out_type": type(out).__name__,
    }


def rank_all_gather(
    shape: tuple[int, ...], dtype: torch.dtype, dim: int, seed: int, transposed: bool
) -> dict[str, Any]:
    from vllm.distributed import get_tp_group, tensor_model_parallel_all_gather

    tp = get_tp_group()
    x = make_input(shape, dtype, seed, tp.rank_in_group)
    if transposed:
        x = x.t()  # a non-contiguous view
    out = tp.device_communicator.all_gather(x, dim)
    via_coordinator = tensor_model_parallel_all_gather(x, dim)
    # torch.distributed's tensor-form gather (concatenation along dim 0).
    reference = torch.empty((WORLD * x.shape[0], *x.shape[1:]), dtype=x.dtype)
    dist.all_gather_into_tensor(reference, x.contiguous(), group=tp.device_group)
    return {
        "out": out,
        "via_coordinator": via_coordinator,
        "reference_dim0": reference,
        "out_type": type(out).__name__,
    }


def rank_compiled(dtype: torch.dtype) -> dict[str, Any]:
    """The same collectives traced into one graph, as in a compiled decoder block."""
    from vllm.distributed import (
        get_tp_group,
        tensor_model_parallel_all_gather,
        tensor_model_parallel_all_reduce,
    )

    def block_like(x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, ...]:
        reduced = tensor_model_parallel_all_reduce(x * 2)  # a row-parallel output
        logits = tensor_model_parallel_all_gather(y, dim=-1)  # a vocab-sharded head
        rows = tensor_model_parallel_all_gather(reduced, dim=0)
        return reduced + 1, logits, rows

    graphs: list[torch.fx.GraphModule] = []

    def recording_backend(gm: torch.fx.GraphModule, example_inputs: list[Any]):
        graphs.append(gm)
        return gm.forward

    rank = get_tp_group().rank_in_group
    x = make_input((8, 64), dtype, 7, rank)
    y = make_input((8, 96), dtype, 8, rank)
    torch._dynamo.reset()
    traced = torch.compile(block_like, backend=recording_backend, fullgraph=True, dynamic=False)
    inductor = torch.compile(block_like, backend="inductor", fullgraph=True, dynamic=False)
    traced_out = traced(x, y)
    collectives = sorted(
        {
            str(node.target)
            for gm in graphs
            for node in gm.graph.nodes
            if node.op == "call_function" and "c10d" in str(node.target)
        }
    )
    return {
        "eager": block_like(x, y),
        "traced": traced_out,
        "inductor": inductor(x, y),
        "graphs": len(graphs),
        "collectives_in_graph": collectives,
    }


def rank_reduce_scatter() -> dict[str, str | None]:
    from vllm.distributed import get_tp_group

    tp = get_tp_group()
    messages: dict[str, str | None] = {}
    for name, call in (
        ("communicator", lambda: tp.device_communicator.reduce_scatter(torch.ones(4, 8), 0)),
        ("coordinator", lambda: tp.reduce_scatter(torch.ones(4, 8), dim=0)),
        ("reduce_scatterv", lambda: tp.reduce_scatterv(torch.ones(4, 8), dim=0)),
    ):
        try:
            call()
            messages[name] = None
        except NotImplementedError as exc:
            messages[name] = str(exc)
    return messages


def rank_upstream_paths(dtype: torch.dtype) -> dict[str, Any]:
    """gather, broadcast and send/recv are inherited (native on the card); they still work."""
    from vllm.distributed import get_tp_group

    tp = get_tp_group()
    rank = tp.rank_in_group
    x = make_input((3, 64), dtype, 11, rank)
    gathered = tp.gather(x, dst=0, dim=-1)
    b = x.clone()
    tp.device_communicator.broadcast(b, src=1)
    if rank == 0:
        tp.device_communicator.send(x, dst=1)
        received = None
    else:
        received = tp.device_communicator.recv(x.shape, dtype, src=0)
    return {"gathered": gathered, "broadcast": b, "received": received}


# ---- tests -----------------------------------------------------------------


def test_backend_map_parsing() -> None:
    assert device_backend_map("cpu:gloo,spyre:spyreccl") == {"cpu": "gloo", "spyre": "spyreccl"}
    assert device_backend_map("gloo") == {"cpu": "gloo"}
    assert device_backend_map("CPU:Gloo") == {"cpu": "gloo"}


def test_platform_names_the_communicator() -> None:
    from vllm.utils.import_utils import resolve_obj_by_qualname

    from spyre_inference.platform import discovery
    from spyre_inference.platform.platform import TorchSpyrePlatform

    assert "spyre" in discovery.available(discovery.COMMUNICATORS_GROUP)
    qualname = TorchSpyrePlatform.get_device_communicator_cls()
    assert qualname == "spyre_inference.comms.SpyreCommunicator"
    assert resolve_obj_by_qualname(qualname) is SpyreCommunicator


def test_tp_group_uses_spyre_communicator_on_gloo(ranks) -> None:
    infos = ranks.run(rank_describe)
    for rank, info in enumerate(infos):
        assert info["is_spyre_communicator"], info["class"]
        assert info["rank_in_group"] == rank
        assert info["world_size"] == WORLD
        # cpu target: gloo serves the whole group, host tensors included.
        assert info["device_backend"] == "gloo"
        assert info["host_is_device_group"]
        # vLLM builds no communicator for the world group.
        assert info["world_communicator"] is None


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(7,), (3, 5), (2, 3, 64), (1, 256)], ids=str)
def test_all_reduce_sums(ranks, shape, dtype) -> None:
    seed = len(shape) * 31 + shape[-1]
    results = ranks.run(rank_all_reduce, shape, dtype, seed)
    a, b = all_inputs(shape, dtype, seed)
    # Two addends: the float32 sum rounded once is the correctly rounded answer.
    expected = (a.float() + b.float()).to(dtype)
    for r in results:
        out = r["out"]
        assert r["out_type"] == "Tensor"  # not an AsyncCollectiveTensor left to wait on
        assert out.dtype == dtype and out.shape == torch.Size(shape)
        assert torch.equal(out, expected)
        assert torch.equal(out, r["reference"])
        assert torch.equal(r["via_coordinator"], expected)
        assert r["input_unchanged"]  # out of place, as GroupCoordinator.all_reduce promises


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(
    ("shape", "dim"),
    [((5,), 0), ((4, 64), 0), ((4, 64), -1), ((4, 64), 1), ((2, 3, 8), 1), ((3, 1000), -1)],
    ids=str,
)
def test_all_gather_concatenates(ranks, shape, dim, dtype) -> None:
    seed = 17 + len(shape) + dim
    results = ranks.run(rank_all_gather, shape, dtype, dim, seed, False)
    expected = torch.cat(all_inputs(shape, dtype, seed), dim=dim)
    for r in results:
        assert r["out_type"] == "Tensor"
        assert r["out"].dtype == dtype
        assert r["out"].shape == expected.shape
        assert torch.equal(r["out"], expected)
        assert torch.equal(r["via_coordinator"], expected)
        if dim == 0:
            assert torch.equal(r["out"], r["reference_dim0"])


def test_all_gather_non_contiguous_input(ranks) -> None:
    shape, dtype, seed = (64, 6), torch.bfloat16, 5
    results = ranks.run(rank_all_gather, shape, dtype, -1, seed, True)
    expected = torch.cat([t.t() for t in all_inputs(shape, dtype, seed)], dim=-1)
    for r in results:
        assert torch.equal(r["out"], expected)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_compiled_graph_matches_eager(ranks, dtype) -> None:
    """Collectives trace into one graph (no break) and compute what eager computes."""
    results = ranks.run(rank_compiled, dtype)
    xs = all_inputs((8, 64), dtype, 7)
    ys = all_inputs((8, 96), dtype, 8)
    reduced = (xs[0].float() * 2 + xs[1].float() * 2).to(dtype)
    for r in results:
        assert r["graphs"] == 1  # fullgraph: one graph, no break
        assert r["collectives_in_graph"] == [
            "_c10d_functional.all_gather_into_tensor",
            "_c10d_functional.all_reduce",
            "_c10d_functional.wait_tensor",
        ]
        eager_reduced, eager_logits, eager_rows = r["eager"]
        assert torch.equal(eager_reduced, reduced + 1)
        assert torch.equal(eager_logits, torch.cat(ys, dim=-1))
        assert torch.equal(eager_rows, torch.cat([reduced, reduced], dim=0))
        for mode in ("traced", "inductor"):
            for got, want in zip(r[mode], r["eager"], strict=True):
                assert got.dtype == want.dtype and got.shape == want.shape
                assert torch.equal(got, want), mode


def test_reduce_scatter_fails_clearly(ranks) -> None:
    for messages in ranks.run(rank_reduce_scatter):
        assert messages == dict.fromkeys(
            ("communicator", "coordinator", "reduce_scatterv"), REDUCE_SCATTER_UNSUPPORTED
        )
    assert "reduce_scatter" in REDUCE_SCATTER_UNSUPPORTED
    assert "--tensor-parallel-size" in REDUCE_SCATTER_UNSUPPORTED


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_inherited_gather_broadcast_send_recv(ranks, dtype) -> None:
    r0, r1 = ranks.run(rank_upstream_paths, dtype)
    a, b = all_inputs((3, 64), dtype, 11)
    assert torch.equal(r0["gathered"], torch.cat([a, b], dim=-1))
    assert r1["gathered"] is None
    assert torch.equal(r0["broadcast"], b) and torch.equal(r1["broadcast"], b)
    assert torch.equal(r1["received"], a)
