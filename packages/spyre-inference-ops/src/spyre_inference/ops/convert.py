"""``spyre_convert``: host<->device placement and dtype conversion as one opaque op.

A device transfer inside a ``torch.compile`` graph would be traced (and on
Spyre, lowered) as part of the graph; torch-spyre cannot lower a
``copy_from_d2d`` or a host round-trip there. Wrapping the conversion in a
``torch.library`` custom op keeps it a single opaque node: Dynamo sees a
function from a tensor to a tensor of known shape, dtype and device, and the
transfer itself runs eagerly. Where the conversion goes (which device, which
dtype rules) is decided by the core's ``spyre_inference.platform.device``, the
one home of placement; this op only makes that decision graph-safe.

On the cpu target the device *is* the host, so a conversion is at most a dtype
cast; the op is the same, so graphs are identical on both targets.
"""

from __future__ import annotations

from typing import Literal

import torch

from spyre_inference.platform.device import device as compute_device
from spyre_inference.platform.device import to_device, to_host

#: Qualified name of the registered op: ``torch.ops.spyre_inference.spyre_convert``.
#: A plugin-owned namespace, not ``spyre``, so it cannot collide with ops
#: torch-spyre registers under its own namespace.
OP_NAMESPACE = "spyre_inference"
OP_NAME = "spyre_convert"
QUALNAME = f"{OP_NAMESPACE}::{OP_NAME}"

Direction = Literal["device", "host"]


def _target_device(direction: str) -> torch.device:
    if direction == "device":
        return compute_device()
    if direction == "host":
        return torch.device("cpu")
    raise ValueError(f"spyre_convert direction must be 'device' or 'host', got {direction!r}")


@torch.library.custom_op(QUALNAME, mutates_args=())
def _spyre_convert_op(x: torch.Tensor, direction: str, dtype: torch.dtype | None) -> torch.Tensor:
    out = to_device(x, dtype) if direction == "device" else to_host(x, dtype)
    _target_device(direction)  # validates direction even when nothing moves
    # A custom op may not return (a view of) its input; when no conversion was
    # needed (always the case for placement on the cpu target) hand back a copy.
    if out is x or out.data_ptr() == x.data_ptr():
        out = out.clone()
    return out


@_spyre_convert_op.register_fake
def _(x: torch.Tensor, direction: str, dtype: torch.dtype | None) -> torch.Tensor:
    return torch.empty_like(
        x,
        dtype=dtype if dtype is not None else x.dtype,
        device=_target_device(direction),
        memory_format=torch.contiguous_format,
    )


def spyre_convert(
    x: torch.Tensor, direction: Direction, dtype: torch.dtype | None = None
) -> torch.Tensor:
    """Move ``x`` to the compute device or the host, optionally changing dtype.

    Eagerly, a conversion with nothing to do returns ``x`` itself (no copy);
    under ``torch.compile`` the call is always the opaque op, so the graph does
    not depend on which target the plugin runs on.
    """
    if not torch.compiler.is_compiling():
        target = _target_device(direction)
        if x.device == target and (dtype is None or x.dtype == dtype):
            return x
    return torch.ops.spyre_inference.spyre_convert(x, direction, dtype)


def to_host_for_sampling(logits: torch.Tensor) -> torch.Tensor:
    """Logits to the host in their own dtype (the sampler casts to float32 there)."""
    return spyre_convert(logits, "host")


__all__ = ["OP_NAME", "OP_NAMESPACE", "QUALNAME", "spyre_convert", "to_host_for_sampling"]
