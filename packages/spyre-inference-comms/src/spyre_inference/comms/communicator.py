"""``SpyreCommunicator``: the collectives vLLM's tensor parallelism issues, Spyre's way.

vLLM reaches every TP collective through ``GroupCoordinator`` ->
``DeviceCommunicatorBase``: the row-parallel linears' and the vocab-parallel
embedding's all-reduce, the logits all-gather, and (in a few features this
plugin does not enable) reduce-scatter. The upstream base class issues them
through the in-place ``torch.distributed`` API and the tensor-form
``all_gather_into_tensor``; both are wrong for Spyre:

* **all_reduce** goes through the *functional* collective
  (``torch.ops._c10d_functional.all_reduce`` + ``wait_tensor``). Inside a
  compiled block graph Dynamo traces it as an ordinary op (torch-spyre lowers it
  to ``spyre::all_reduce_async``); outside a graph it runs eagerly on the same
  process group (libspyre_comms on the card, gloo on the host). One code path
  serves both modes, so a block computes the same thing compiled or eager.
* **all_gather** is functional inside a compiled graph (it lowers to
  ``spyre::all_gather_async`` and the logits stay on the device), but eager
  calls use the list-form ``dist.all_gather``: torch-spyre's spyreccl backend
  stubs ``_allgather_base`` (so ``all_gather_into_tensor`` fails), and the
  functional entry point outside a graph reaches
  ``allgather_into_tensor_coalesced``, which spyreccl rejects.
* **reduce_scatter** raises: it is not on the TP forward path and neither
  spyreccl form of it is usable.

Host tensors always travel through gloo: on the card the process group is the
multi-backend ``cpu:gloo,spyre:spyreccl`` (torch dispatches on the tensor's
device), and on the cpu target gloo serves everything. ``gather``, ``broadcast``
and ``send``/``recv`` are upstream's: libspyre_comms implements them natively.

The probe suite ``tests/probes/test_spyre_comms_native_probes.py`` records each
of these workarounds as a strict xfail on a card; when a probe passes, the
matching override here can go.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup
from vllm.distributed.device_communicators.base_device_communicator import (
    DeviceCommunicatorBase,
)

from spyre_inference.platform import device as dev
from spyre_inference.platform import emulated_card
from spyre_inference.platform.logs import get_logger

logger = get_logger(__name__)

#: The process-group backend on a Spyre card: gloo for host tensors, the
#: torch-spyre collective library for device tensors.
SPYRE_PG_BACKEND = "cpu:gloo,spyre:spyreccl"

REDUCE_SCATTER_UNSUPPORTED = (
    "SpyreCommunicator does not implement reduce_scatter: it is not on the tensor-parallel "
    "forward path, and torch-spyre's spyreccl backend has no usable reduce-scatter "
    "(reduce is a stub). It is only reached through features spyre-inference does not "
    "support (sequence parallelism, data/expert parallelism with all2all). Run with plain "
    "--tensor-parallel-size and without those options."
)


def device_backend_map(backend: str) -> dict[str, str]:
    """Which backend serves which device type in a process group's backend string.

    ``"cpu:gloo,spyre:spyreccl"`` maps each device explicitly; a bare name
    (``"gloo"``) serves the host, which is all this plugin needs to know of it.
    """
    backend = backend.lower()
    if ":" not in backend:
        return {"cpu": backend}
    pairs = (item.split(":", 1) for item in backend.split(",") if item)
    return {device.strip(): name.strip() for device, name in pairs}


def group_backend(group: ProcessGroup) -> str:
    """The backend string a process group was created with (``""`` if unregistered)."""
    try:
        return str(dist.get_backend(group))
    except (ValueError, RuntimeError):
        # Stateless groups (elastic EP) are not in torch's group map.
        return ""


class SpyreCommunicator(DeviceCommunicatorBase):
    """Tensor-parallel collectives on Spyre (and on the cpu target, through gloo)."""

    def __init__(
        self,
        cpu_group: ProcessGroup,
        device: torch.device | None = None,
        device_group: ProcessGroup | None = None,
        unique_name: str = "",
        global_ranks: list[int] | None = None,
        global_world_size: int | None = None,
        use_all2all: bool = False,
    ) -> None:
        super().__init__(
            cpu_group,
            device,
            device_group,
            unique_name,
            global_ranks,
            global_world_size,
            use_all2all,
        )
        if self.device_group is None:
            # GroupCoordinator always passes one; a bare construction (tests,
            # tools) gets the gloo group, which serves host tensors.
            self.device_group = cpu_group
        self._emulated = dev.is_emulated()
        if dev.has_card():
            self.device_group = self._spyre_device_group(self.device_group)
        backends = device_backend_map(group_backend(self.device_group))
        # Host tensors go through a gloo group: the device group itself when
        # gloo serves its host half (cpu:gloo,... or plain gloo), else vLLM's
        # own gloo cpu_group.
        self.host_group = self.device_group if backends.get("cpu") == "gloo" else cpu_group
        # Names, not groups, for the functional ops: inside a compiled graph
        # Dynamo then only sees string constants, never a ProcessGroup object.
        self._device_group_name: str = self.device_group.group_name
        self._host_group_name: str = self.host_group.group_name
        logger.debug(
            "SpyreCommunicator %s: rank %d/%d, device group backend %s",
            unique_name,
            self.rank_in_group,
            self.world_size,
            group_backend(self.device_group) or "unregistered",
        )

    def _spyre_device_group(self, group: ProcessGroup) -> ProcessGroup:
        """The ``cpu:gloo,spyre:spyreccl`` group over this communicator's ranks.

        The worker normally creates vLLM's groups with that backend, so the
        given group already is one. If it is not (a worker that passed plain
        gloo), device tensors would reach gloo, which cannot read Spyre memory:
        build the multi-backend group here. Only this group's members take
        part, so ``use_local_synchronization`` keeps other ranks out of it.
        """
        if device_backend_map(group_backend(group)).get("spyre") == "spyreccl":
            return group
        logger.warning(
            "TP group %s was created with backend %r; creating a %s group for device "
            "collectives. Create the distributed environment with backend %r to avoid "
            "the extra group.",
            self.unique_name,
            group_backend(group),
            SPYRE_PG_BACKEND,
            SPYRE_PG_BACKEND,
        )
        return dist.new_group(self.ranks, backend=SPYRE_PG_BACKEND, use_local_synchronization=True)

    def _group_for(self, tensor: torch.Tensor) -> ProcessGroup:
        return self.host_group if tensor.device.type == "cpu" else self.device_group

    def _group_name_for(self, tensor: torch.Tensor) -> str:
        return self._host_group_name if tensor.device.type == "cpu" else self._device_group_name

    # ---- collectives -----------------------------------------------------

    def all_reduce(self, input_: torch.Tensor) -> torch.Tensor:
        """Sum over the group through the functional collective (out of place).

        The same two ops run eagerly and inside a compiled block graph, where
        Dynamo records them as graph nodes and Inductor (or torch-spyre)
        schedules the wait.
        """
        if self._emulated_eager(input_):
            return emulated_card.device_view(self.all_reduce(emulated_card.host_view(input_)))
        name = self._group_name_for(input_)
        out = torch.ops._c10d_functional.all_reduce(input_, "sum", name)
        return torch.ops._c10d_functional.wait_tensor(out)

    def _emulated_eager(self, tensor: torch.Tensor) -> bool:
        """An eager collective of an emulated card's tensor (the spyreccl stand-in).

        On a card spyreccl reads device memory; on the emulated card gloo runs
        the collective on zero-copy host views of it (in compiled graphs the
        emulated compiler already computes on host views).
        """
        return (
            self._emulated and tensor.device.type == "spyre" and not torch.compiler.is_compiling()
        )

    def all_gather(self, input_: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """Concatenate every rank's ``input_`` along ``dim``, in rank order."""
        if dim < 0:
            dim += input_.dim()
        if torch.compiler.is_compiling():
            # In a graph: the functional form, which stays on the device.
            # It gathers along dim 0; move the rank axis to ``dim`` after.
            size = input_.size()
            out = torch.ops._c10d_functional.all_gather_into_tensor(
                input_.contiguous(), self.world_size, self._group_name_for(input_)
            )
            out = torch.ops._c10d_functional.wait_tensor(out)
            out = out.reshape((self.world_size, *size)).movedim(0, dim)
            return out.reshape((*size[:dim], self.world_size * size[dim], *size[dim + 1 :]))
        if self._emulated_eager(input_):
            host = self.all_gather(emulated_card.host_view(input_), dim)
            return emulated_card.device_view(host)
        # Eager: list-form all_gather, the one spyreccl implements natively.
        input_ = input_.contiguous()
        parts = [torch.empty_like(input_) for _ in range(self.world_size)]
        dist.all_gather(parts, input_, group=self._group_for(input_))
        return torch.cat(parts, dim=dim)

    def reduce_scatter(self, input_: torch.Tensor, dim: int = -1) -> torch.Tensor:
        raise NotImplementedError(REDUCE_SCATTER_UNSUPPORTED)

    def reduce_scatterv(
        self, input_: torch.Tensor, dim: int = -1, sizes: list[int] | None = None
    ) -> torch.Tensor:
        raise NotImplementedError(REDUCE_SCATTER_UNSUPPORTED)


__all__ = [
    "REDUCE_SCATTER_UNSUPPORTED",
    "SPYRE_PG_BACKEND",
    "SpyreCommunicator",
    "device_backend_map",
    "group_backend",
]
