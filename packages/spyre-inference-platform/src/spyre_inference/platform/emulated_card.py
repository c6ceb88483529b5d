"""The emulated Spyre card: the spyre target's code path on host memory.

On the cpu target host and device are one memory, so a tensor on the wrong
side is invisible. The emulated target (``SPYRE_DEVICE_TARGET=emulated``,
never chosen by ``auto``) runs the code the card runs (float16 only, the
card's attention forms, no host kernels) on a device of its own:

* **A device type of its own.** A small C++ extension
  (``csrc/emulated_device.cpp``) registers torch's ``PrivateUse1`` backend,
  renamed ``spyre`` as torch-spyre names it, with an allocator in host memory.
  Its tensors refuse to mix with host tensors the way torch-spyre's do, and
  bool / small-integer tensors cannot be placed on it.
* **Kernels borrowed from the CPU.** Every aten op runs the CPU kernel on
  zero-copy host views of its device operands and returns device tensors.
* **The card's compiler stand-in.** torch-spyre ships an Inductor backend for
  the ``spyre`` device; here :func:`compile_backend` compiles each Dynamo graph
  with Inductor's CPU code generator on host views of its inputs. Dynamo's
  fake-tensor tracing runs on ``spyre`` tensors first, so a graph that mixes
  devices fails while it is traced, as it would on the card. Opaque custom ops
  inside a graph (attention, MoE) are handed device tensors, so their own
  placement is checked too.
* **The card's memory accounting.** Allocations are charged against a fixed
  device size (``SPYRE_EMULATED_DEVICE_MEMORY_GB``); the KV budget is computed
  from it, not from host RAM, and running out raises ``OutOfMemoryError``.
* **Counted transfers.** Every host<->device copy is counted by the device
  itself (:func:`transfer_counts`), so tests can check that every transfer
  went through :mod:`spyre_inference.platform.device`.

What it cannot show: the numerics of torch-spyre's compiler and kernels, and
performance. Those need a card.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import operator
import types
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from spyre_inference.platform import settings
from spyre_inference.platform.logs import get_logger
from spyre_inference.platform.native_build import load_torch_extension

logger = get_logger(__name__)

DEVICE_NAME = "spyre"
SOURCE = Path(__file__).parent / "csrc" / "emulated_device.cpp"
GiB = 1 << 30


class _DeviceModule:
    """``torch.spyre`` on the emulated target: one card, always available."""

    @staticmethod
    def is_available() -> bool:
        return True

    @staticmethod
    def is_initialized() -> bool:
        return True

    @staticmethod
    def device_count() -> int:
        return 1

    @staticmethod
    def current_device() -> int:
        return 0

    @staticmethod
    def _is_in_bad_fork() -> bool:
        return False

    @staticmethod
    def manual_seed_all(seed: int) -> None:
        return None

    @staticmethod
    def synchronize(device: Any = None) -> None:
        return None

    @staticmethod
    def mem_get_info(device: Any = None) -> tuple[int, int]:
        """(free, total) bytes of the emulated card, as ``torch.cuda.mem_get_info``."""
        stats = memory_stats()
        return stats.capacity - stats.in_use, stats.capacity


@functools.cache
def _source_key() -> str:
    text = SOURCE.read_bytes() + Path(__file__).read_bytes() + torch.__version__.encode()
    return hashlib.sha256(text).hexdigest()[:12]


@functools.cache
def _extension() -> types.ModuleType:
    ext = load_torch_extension(SOURCE)
    assert ext is not None
    return ext


@functools.cache
def install() -> types.ModuleType:
    """Build, load and register the emulated device (once per process)."""
    if torch._C._get_privateuse1_backend_name() not in ("privateuseone", DEVICE_NAME):
        raise RuntimeError(
            "SPYRE_DEVICE_TARGET=emulated: torch's PrivateUse1 backend is already "
            f"taken by {torch._C._get_privateuse1_backend_name()!r}"
        )
    ext = _extension()
    from torch.utils.backend_registration import _setup_privateuseone_for_python_backend

    _setup_privateuseone_for_python_backend(rename=DEVICE_NAME, backend_module=_DeviceModule())
    from torch._dynamo.device_interface import CpuInterface, register_interface_for_device

    register_interface_for_device(DEVICE_NAME, CpuInterface)
    # Compiled graphs compute on the host (compile_backend); the only device
    # tensors Inductor sees there are the operands of opaque custom ops, for
    # which its wrapper code needs the device's (no-op) guard and stream code.
    from torch._inductor.codegen.common import (
        register_backend_for_device,
        register_device_op_overrides,
    )
    from torch._inductor.codegen.cpp import CppScheduling
    from torch._inductor.codegen.cpu_device_op_overrides import CpuDeviceOpOverrides
    from torch._inductor.codegen.wrapper import PythonWrapperCodegen

    register_device_op_overrides(DEVICE_NAME, CpuDeviceOpOverrides())
    register_backend_for_device(DEVICE_NAME, CppScheduling, PythonWrapperCodegen)
    ext.set_capacity(int(settings.get("SPYRE_EMULATED_DEVICE_MEMORY_GB") * GiB))
    logger.info(
        "emulated Spyre card: %.1f GiB of device memory in host RAM",
        settings.get("SPYRE_EMULATED_DEVICE_MEMORY_GB"),
    )
    return ext


# ---- counters -------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class MemoryStats:
    in_use: int
    peak: int
    capacity: int


def transfer_counts() -> tuple[int, int]:
    """(host-to-device, device-to-host) copies the device has made."""
    h2d, d2h, _, _ = install().counters()
    return int(h2d), int(d2h)


def memory_stats() -> MemoryStats:
    _, _, in_use, peak = install().counters()
    return MemoryStats(int(in_use), int(peak), int(install().capacity()))


def reset_counters() -> None:
    install().reset_counters()


# ---- the compiler stand-in ------------------------------------------------

_HOST = torch.device("cpu")


def _host_device(value: Any) -> Any:
    """``value`` with every spyre device in it replaced by the host."""
    if isinstance(value, torch.device) and value.type == DEVICE_NAME:
        return _HOST
    if isinstance(value, str) and value.split(":")[0] == DEVICE_NAME:
        return "cpu"
    if isinstance(value, (list, tuple)):
        return type(value)(_host_device(v) for v in value)
    if isinstance(value, dict):
        return {k: _host_device(v) for k, v in value.items()}
    return value


def _custom_op_schema(target: Any) -> torch._C.FunctionSchema | None:
    """The schema of a call target that is a custom (non-aten) op, else None."""
    if isinstance(target, torch._ops.OpOverloadPacket):
        overloads = target.overloads()
        target = getattr(target, "default" if "default" in overloads else overloads[0])
    if not isinstance(target, torch._ops.OpOverload):
        return None
    # Functional collectives stay in the host graph: there gloo runs them on
    # the host views, the stand-in for the card's in-graph collectives.
    if target.namespace in ("aten", "prims", "spyre_emulated", "_c10d_functional"):
        return None
    return target._schema


def _to_host(t: Any) -> Any:
    """A zero-copy host view of a device tensor (anything else unchanged)."""
    return (
        install().host_view(t)
        if isinstance(t, torch.Tensor) and t.device.type == DEVICE_NAME
        else t
    )


def _on_device(t: Any) -> Any:
    """A zero-copy device view of a host tensor (anything else unchanged)."""
    return install().device_view(t) if isinstance(t, torch.Tensor) and t.device.type == "cpu" else t


def host_view(t: torch.Tensor) -> torch.Tensor:
    """The host tensor over a device tensor's bytes (no copy, not a transfer).

    For stand-ins of the card's own libraries (its collectives), which read
    device memory directly on a card.
    """
    return _to_host(t)


def device_view(t: torch.Tensor) -> torch.Tensor:
    """The device tensor over a host tensor's bytes (no copy, not a transfer)."""
    return _on_device(t)


# The compiled host graph hands an opaque custom op its operands on the device
# and takes its results back through these two ops. They copy: a view would
# let Inductor reuse the source buffer's memory while the view is still read.
# They are not transfers of the card (there the graph never leaves the
# device), so they are not counted.
@torch.library.custom_op("spyre_emulated::graph_to_device", mutates_args=())
def _graph_to_device(x: torch.Tensor) -> torch.Tensor:
    return _on_device(x.clone(memory_format=torch.contiguous_format))


@_graph_to_device.register_fake
def _(x: torch.Tensor) -> torch.Tensor:
    return torch.empty(x.shape, dtype=x.dtype, device=DEVICE_NAME)


@torch.library.custom_op("spyre_emulated::graph_to_host", mutates_args=())
def _graph_to_host(x: torch.Tensor) -> torch.Tensor:
    return _to_host(x).clone(memory_format=torch.contiguous_format)


@_graph_to_host.register_fake
def _(x: torch.Tensor) -> torch.Tensor:
    return torch.empty(x.shape, dtype=x.dtype, device="cpu")


def _traced_on_device(item: Any) -> bool:
    val = item.meta.get("example_value") if isinstance(item, torch.fx.Node) else None
    return isinstance(val, torch.Tensor) and val.device.type == DEVICE_NAME


def _wrap_custom_op(graph: torch.fx.Graph, node: torch.fx.Node) -> None:
    """Device operands in, host results out, in-place writes copied back."""
    to_device = torch.ops.spyre_emulated.graph_to_device.default
    to_host = torch.ops.spyre_emulated.graph_to_host.default
    moved: dict[torch.fx.Node, torch.fx.Node] = {}

    def place(arg: torch.fx.Node) -> torch.fx.Node:
        if not _traced_on_device(arg):
            return arg
        if arg not in moved:
            with graph.inserting_before(node):
                moved[arg] = graph.call_function(to_device, (arg,))
                moved[arg].meta.update(arg.meta)
        return moved[arg]

    node.args = torch.fx.node.map_arg(node.args, place)
    node.kwargs = torch.fx.node.map_arg(node.kwargs, place)
    after = node
    schema = _custom_op_schema(node.target)
    written = {
        a.name
        for a in (schema.arguments if schema else [])
        if a.alias_info and a.alias_info.is_write
    }
    for index, a in enumerate(schema.arguments if schema else []):
        if a.name not in written:
            continue
        value = node.kwargs.get(a.name, node.args[index] if index < len(node.args) else None)
        original = next((k for k, v in moved.items() if v is value), None)
        if original is None:
            continue
        with graph.inserting_after(after):
            back = graph.call_function(to_host, (value,))
        with graph.inserting_after(back):
            after = graph.call_function(torch.ops.aten.copy_.default, (original, back))
    results = (
        [node]
        if _traced_on_device(node)
        else [u for u in node.users if u.target is operator.getitem and _traced_on_device(u)]
    )
    for result in results:
        users = list(result.users)
        with graph.inserting_after(result if result is not node else after):
            host = graph.call_function(to_host, (result,))
        for user in users:
            user.replace_input_with(result, host)


def _host_graph(gm: torch.fx.GraphModule) -> list[bool]:
    """Rewrite ``gm`` to compute on the host; which outputs live on the device."""
    for name, value in list(gm.named_buffers()) + list(gm.named_parameters()):
        if value.device.type == DEVICE_NAME:
            owner, _, attr = name.rpartition(".")
            mod = gm.get_submodule(owner) if owner else gm
            host = _to_host(value)
            if isinstance(value, torch.nn.Parameter):
                host = torch.nn.Parameter(host, requires_grad=False)
            setattr(mod, attr, host)
    for node in list(gm.graph.nodes):
        if node.op == "get_attr":
            value = operator.attrgetter(node.target)(gm)
            if isinstance(value, torch.Tensor) and value.device.type == DEVICE_NAME:
                owner, _, attr = node.target.rpartition(".")
                setattr(gm.get_submodule(owner) if owner else gm, attr, _to_host(value))
        if node.op in ("call_function", "call_method"):
            node.args = _host_device(node.args)
            node.kwargs = _host_device(node.kwargs)
        if node.op == "call_function" and _custom_op_schema(node.target) is not None:
            # Inductor keeps a custom op opaque and runs its Python body, which
            # must see device tensors as it does on the card.
            _wrap_custom_op(gm.graph, node)
    gm.graph.lint()
    gm.recompile()
    output = next(n for n in gm.graph.nodes if n.op == "output")
    flat, _ = torch.utils._pytree.tree_flatten(output.args[0])
    return [_traced_on_device(item) for item in flat]


def _host_example(x: Any) -> Any:
    """The host view of one of Dynamo's example inputs, with the input's shape context.

    Dynamo hands the backend the real input tensors and records, per tensor,
    how its sizes were traced (static here: ``dynamic=False``); Inductor looks
    each input up there when it fakes it. A host view is a new tensor with no
    record, so AOTAutograd would fake it with fresh sourceless symbolic sizes,
    and the first guard a view or reshape puts on them fails at guard building
    ("sources must not be empty for symbol s26", or IndexError in
    produce_guards; seen in CI on the page-attention graph). The view inherits
    the device tensor's record.
    """
    host = _to_host(x)
    context = torch._guards.TracingContext.try_get()
    if host is not x and context is not None and x in context.tensor_to_context:
        context.tensor_to_context[host] = context.tensor_to_context[x]
    return host


def compile_backend(gm: torch.fx.GraphModule, example_inputs: Sequence[Any]) -> Callable:
    """torch-spyre's Inductor backend stand-in (see the module docstring)."""
    from torch._inductor.compile_fx import compile_fx

    on_device = _host_graph(gm)
    host_inputs = [_host_example(x) for x in example_inputs]
    # Inductor's on-disk cache keys on the graph, not on this module's custom
    # ops and rewrite: tag the key with their source so an edit never loads a
    # graph compiled by an older stand-in.
    with torch.compiler.config.patch(cache_key_tag=f"spyre-emulated-{_source_key()}"):
        compiled = compile_fx(gm, host_inputs)

    def run(*args: Any) -> Any:
        out = compiled(*[_to_host(x) for x in args])
        flat, spec = torch.utils._pytree.tree_flatten(out)
        if len(flat) == len(on_device):
            flat = [_on_device(x) if dev else x for x, dev in zip(flat, on_device, strict=True)]
        return torch.utils._pytree.tree_unflatten(flat, spec)

    return run


__all__ = [
    "DEVICE_NAME",
    "MemoryStats",
    "compile_backend",
    "device_view",
    "host_view",
    "install",
    "memory_stats",
    "reset_counters",
    "transfer_counts",
]
