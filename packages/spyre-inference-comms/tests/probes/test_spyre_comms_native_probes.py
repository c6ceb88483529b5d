"""Probes of torch-spyre's native collectives: the canonical signal for SpyreCommunicator.

Each probe calls one native collective directly (no plugin code in between)
on two ranks of a ``cpu:gloo,spyre:spyreccl`` group and checks the result. On a
card:

* probes of what ``SpyreCommunicator`` relies on (functional all-reduce eager
  and compiled, list-form all-gather, gather, broadcast, send/recv, barrier)
  must pass;
* probes of what it works around are **strict xfails**. When torch-spyre fixes
  one, its probe passes, strict xfail turns that into a failure, and the
  failure names the override or workaround to delete (the ``reason``).

Without a card the ``spyre`` tests are skipped. The probe bodies themselves are
still checked on every run: ``test_probe_bodies_pass_on_gloo`` runs each one on
host tensors over gloo, where every collective works, so a probe that fails on
a card fails because of the card's library, not because the probe is wrong.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator

import pytest
import torch
import torch.distributed as dist
from rank_pair import Ranks

from spyre_inference.comms import SPYRE_PG_BACKEND, SpyreCommunicator


@functools.cache
def card_present() -> bool:
    from spyre_inference.platform import device

    return device.is_spyre()


def needs_card(test: Callable) -> Callable:
    """Mark a test ``spyre`` and skip it on hosts without a card."""
    skip = pytest.mark.skipif(not card_present(), reason="needs a Spyre card (torch-spyre)")
    return pytest.mark.spyre(skip(test))


# ---- probe bodies (run on every rank) ---------------------------------------


def _tp() -> tuple[dist.ProcessGroup, int, int]:
    from vllm.distributed import get_tp_group

    tp = get_tp_group()
    return tp.device_group, tp.rank_in_group, tp.world_size


def _input(rank: int, device: str, dtype: torch.dtype, rows: int = 4) -> torch.Tensor:
    """Small integers, exact in float16: a wrong sum or order cannot round away."""
    base = torch.arange(rows * 64, dtype=torch.float32).reshape(rows, 64) % 7
    return (base + 10 * rank).to(dtype).to(device)


def _sum(world: int, dtype: torch.dtype, rows: int = 4) -> torch.Tensor:
    return sum(_input(r, "cpu", dtype, rows) for r in range(world))


def _cat(world: int, dtype: torch.dtype, dim: int = 0) -> torch.Tensor:
    return torch.cat([_input(r, "cpu", dtype) for r in range(world)], dim=dim)


def _same(got: torch.Tensor, want: torch.Tensor) -> None:
    torch.testing.assert_close(got.cpu(), want, rtol=0, atol=0)


def probe_all_reduce_inplace(device: str, dtype: torch.dtype) -> None:
    group, rank, world = _tp()
    x = _input(rank, device, dtype)
    dist.all_reduce(x, group=group)
    _same(x, _sum(world, dtype))


def probe_all_reduce_functional_eager(device: str, dtype: torch.dtype) -> None:
    """SpyreCommunicator.all_reduce's eager path (libspyre_comms outside a graph)."""
    group, rank, world = _tp()
    x = _input(rank, device, dtype)
    out = torch.ops._c10d_functional.all_reduce(x, "sum", group.group_name)
    _same(torch.ops._c10d_functional.wait_tensor(out), _sum(world, dtype))


def probe_functional_collectives_compiled(device: str, dtype: torch.dtype) -> None:
    """Both functional collectives inside one compiled graph (spyre::*_async on a card)."""
    group, rank, world = _tp()
    name = group.group_name

    def graph(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        reduced = torch.ops._c10d_functional.all_reduce(x, "sum", name)
        reduced = torch.ops._c10d_functional.wait_tensor(reduced)
        gathered = torch.ops._c10d_functional.all_gather_into_tensor(x, world, name)
        return reduced, torch.ops._c10d_functional.wait_tensor(gathered)

    compiled = torch.compile(graph, backend="inductor", fullgraph=True, dynamic=False)
    reduced, gathered = compiled(_input(rank, device, dtype))
    _same(reduced, _sum(world, dtype))
    _same(gathered, _cat(world, dtype))


def probe_all_gather_list(device: str, dtype: torch.dtype) -> None:
    """SpyreCommunicator.all_gather's eager path."""
    group, rank, world = _tp()
    x = _input(rank, device, dtype)
    parts = [torch.empty_like(x) for _ in range(world)]
    dist.all_gather(parts, x, group=group)
    _same(torch.cat(parts), _cat(world, dtype))


def probe_gather(device: str, dtype: torch.dtype) -> None:
    """Inherited DeviceCommunicatorBase.gather (used for logits when all-gather is off)."""
    group, rank, world = _tp()
    x = _input(rank, device, dtype)
    dst = dist.get_global_rank(group, 0)
    parts = [torch.empty_like(x) for _ in range(world)] if rank == 0 else None
    dist.gather(x, parts, dst=dst, group=group)
    if rank == 0:
        _same(torch.cat(parts), _cat(world, dtype))


def probe_broadcast(device: str, dtype: torch.dtype) -> None:
    group, rank, world = _tp()
    x = _input(rank, device, dtype)
    dist.broadcast(x, src=dist.get_global_rank(group, world - 1), group=group)
    _same(x, _input(world - 1, "cpu", dtype))


def probe_send_recv(device: str, dtype: torch.dtype) -> None:
    group, rank, _ = _tp()
    x = _input(rank, device, dtype)
    if rank == 0:
        dist.send(x, dst=dist.get_global_rank(group, 1), group=group)
    elif rank == 1:
        y = torch.empty_like(x)
        dist.recv(y, src=dist.get_global_rank(group, 0), group=group)
        _same(y, _input(0, "cpu", dtype))


def probe_barrier(device: str, dtype: torch.dtype) -> None:
    group, _, _ = _tp()
    dist.barrier(group=group)


def probe_communicator(device: str, dtype: torch.dtype) -> None:
    """SpyreCommunicator itself on device tensors: the product path, eagerly."""
    from vllm.distributed import get_tp_group

    comm = get_tp_group().device_communicator
    assert isinstance(comm, SpyreCommunicator)
    _, rank, world = _tp()
    x = _input(rank, device, dtype)
    _same(comm.all_reduce(x), _sum(world, dtype))
    _same(comm.all_gather(x, dim=-1), _cat(world, dtype, dim=-1))


# -- what SpyreCommunicator works around (expected to fail on a card today) --


def probe_all_gather_into_tensor(device: str, dtype: torch.dtype) -> None:
    """spyreccl stubs _allgather_base, which all_gather_into_tensor calls."""
    group, rank, world = _tp()
    x = _input(rank, device, dtype)
    out = torch.empty((world * x.shape[0], x.shape[1]), dtype=dtype, device=device)
    dist.all_gather_into_tensor(out, x, group=group)
    _same(out, _cat(world, dtype))


def probe_all_gather_functional_eager(device: str, dtype: torch.dtype) -> None:
    """Outside a graph the functional form reaches allgather_into_tensor_coalesced."""
    group, rank, world = _tp()
    x = _input(rank, device, dtype)
    out = torch.ops._c10d_functional.all_gather_into_tensor(x, world, group.group_name)
    _same(torch.ops._c10d_functional.wait_tensor(out), _cat(world, dtype))


def probe_reduce(device: str, dtype: torch.dtype) -> None:
    """libspyre_comms' reduce is a throw-stub."""
    group, rank, world = _tp()
    x = _input(rank, device, dtype)
    dist.reduce(x, dst=dist.get_global_rank(group, 0), group=group)
    if rank == 0:
        _same(x, _sum(world, dtype))


def probe_reduce_scatter_tensor(device: str, dtype: torch.dtype) -> None:
    """What upstream's DeviceCommunicatorBase.reduce_scatter calls."""
    group, rank, world = _tp()
    rows = 2 * world
    x = _input(rank, device, dtype, rows=rows)
    out = torch.empty((rows // world, 64), dtype=dtype, device=device)
    dist.reduce_scatter_tensor(out, x, group=group)
    _same(out, _sum(world, dtype, rows=rows).chunk(world)[rank])


WORKS: dict[str, Callable[[str, torch.dtype], None]] = {
    "all_reduce_inplace": probe_all_reduce_inplace,
    "all_reduce_functional_eager": probe_all_reduce_functional_eager,
    "functional_collectives_compiled": probe_functional_collectives_compiled,
    "all_gather_list": probe_all_gather_list,
    "gather": probe_gather,
    "broadcast": probe_broadcast,
    "send_recv": probe_send_recv,
    "barrier": probe_barrier,
    "communicator": probe_communicator,
}

#: probe -> what to delete or change when it starts passing on a card.
WORKAROUNDS: dict[str, tuple[Callable[[str, torch.dtype], None], str]] = {
    "all_gather_into_tensor": (
        probe_all_gather_into_tensor,
        "native: delete the eager list-form branch of SpyreCommunicator.all_gather "
        "(upstream's tensor-form all_gather then works)",
    ),
    "all_gather_functional_eager": (
        probe_all_gather_functional_eager,
        "native: SpyreCommunicator.all_gather can use the functional form in eager mode "
        "too (one code path, like all_reduce)",
    ),
    "reduce": (
        probe_reduce,
        "native: libspyre_comms implements reduce; nothing in the plugin works around it, "
        "update the spec's list of stubs",
    ),
    "reduce_scatter_tensor": (
        probe_reduce_scatter_tensor,
        "native: implement SpyreCommunicator.reduce_scatter instead of raising",
    ),
}


# ---- tests -----------------------------------------------------------------


@pytest.fixture(scope="module")
def card_ranks() -> Iterator[Ranks]:
    """Two ranks on the card, in a cpu:gloo,spyre:spyreccl TP group."""
    pair = Ranks(world_size=2, backend=SPYRE_PG_BACKEND, target="spyre")
    yield pair
    pair.close()


@needs_card
@pytest.mark.parametrize("name", list(WORKS))
def test_native_collective_works(card_ranks, name: str) -> None:
    card_ranks.run(WORKS[name], "spyre", torch.float16)


@needs_card
@pytest.mark.parametrize(
    "name",
    [
        pytest.param(name, marks=pytest.mark.xfail(strict=True, reason=reason))
        for name, (_, reason) in WORKAROUNDS.items()
    ],
)
def test_native_collective_still_broken(card_ranks, name: str) -> None:
    card_ranks.run(WORKAROUNDS[name][0], "spyre", torch.float16)


@pytest.mark.parametrize("name", [*WORKS, *WORKAROUNDS])
def test_probe_bodies_pass_on_gloo(ranks, name: str) -> None:
    """Every probe is a correct program: on host tensors over gloo it passes."""
    probe = WORKS[name] if name in WORKS else WORKAROUNDS[name][0]
    ranks.run(probe, "cpu", torch.float16)
