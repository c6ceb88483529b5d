"""Zero-padding checkpoint tensors to the widened head / MLP sizes as they load.

The platform widens ``head_dim`` and ``intermediate_size`` in the model config
before the model is built (``spyre_inference.platform.stick_pad``), so every
vLLM layer is created at the padded width while the checkpoint still holds the
original one. The Spyre linear layers' weight loaders call the functions here
to pad each incoming tensor, then hand it to vLLM's own loader, which shards it
for tensor parallelism exactly as before: padding the full tensor first keeps
TP sharding untouched.

Two layouts:

* :func:`pad_heads` (Q, K, V rows and O columns): each head ``[x1, x2]`` (the
  two neox rotary halves) becomes ``[x1, 0, x2, 0]``, so the rotation pairs
  stay ``padded/2`` apart. V and O use the same layout; for them any layout
  would do as long as they agree.
* :func:`pad_tail` (MLP gate/up rows, down columns): zeros appended.
"""

from __future__ import annotations

import torch

from spyre_inference.platform.stick_pad import DimPad, StickPadPlan


def pad_heads(t: torch.Tensor, dim: int, pad: DimPad) -> torch.Tensor:
    """Widen every head along ``dim`` from ``pad.original`` to ``pad.padded``."""
    size = t.shape[dim]
    if size % pad.original:
        raise ValueError(
            f"cannot pad heads: dimension {dim} has {size} entries, not a multiple of "
            f"head_dim={pad.original}"
        )
    num_heads = size // pad.original
    half, half_padded = pad.original // 2, pad.padded // 2
    moved = t.movedim(dim, 0)
    rest = moved.shape[1:]
    halves = moved.reshape(num_heads, 2, half, *rest)
    zeros = halves.new_zeros(num_heads, 2, half_padded - half, *rest)
    widened = torch.cat((halves, zeros), dim=2).reshape(num_heads * pad.padded, *rest)
    return widened.movedim(0, dim).contiguous()


def pad_tail(t: torch.Tensor, dim: int, padded: int) -> torch.Tensor:
    """Append zeros along ``dim`` up to ``padded`` entries."""
    size = t.shape[dim]
    if size == padded:
        return t
    if size > padded:
        raise ValueError(f"cannot pad dimension {dim} of size {size} down to {padded}")
    shape = list(t.shape)
    shape[dim] = padded - size
    return torch.cat((t, t.new_zeros(shape)), dim=dim)


def pad_qkv_shard(
    loaded: torch.Tensor, dim: int, num_heads: int, pad: DimPad | None
) -> torch.Tensor:
    """Pad one Q, K or V shard of ``num_heads`` (TP-global) heads, if it is unpadded."""
    if pad is None or loaded.shape[dim] != num_heads * pad.original:
        return loaded
    return pad_heads(loaded, dim, pad)


def pad_row_input(
    loaded: torch.Tensor, dim: int, expected: int, plan: StickPadPlan | None, prefix: str
) -> torch.Tensor:
    """Pad the input columns of a row-parallel weight to the layer's input size.

    The layer only knows its (widened) input size; the checkpoint tensor tells
    which widening applies: ``n * head_dim`` columns of an O projection or the
    ``intermediate_size`` columns of a down projection.
    """
    size = loaded.shape[dim]
    if plan is None or size == expected:
        return loaded
    head, mlp = plan.head_dim, plan.intermediate_size
    is_heads = head is not None and size % head.original == 0
    is_heads = is_heads and (size // head.original) * head.padded == expected
    is_mlp = mlp is not None and size == mlp.original and expected == mlp.padded
    if is_heads and is_mlp:
        raise NotImplementedError(
            f"{prefix}: {size} input columns match both the head padding ({head}) and the "
            f"MLP padding ({mlp}); spyre-inference cannot tell which applies."
        )
    if is_heads:
        return pad_heads(loaded, dim, head)
    if is_mlp:
        return pad_tail(loaded, dim, mlp.padded)
    return loaded


def pad_mlp_output(
    loaded: torch.Tensor, dim: int, expected: int, plan: StickPadPlan | None
) -> torch.Tensor:
    """Pad a gate/up (or fc1) output block from ``intermediate_size`` to the padded width."""
    mlp = plan.intermediate_size if plan is not None else None
    if mlp is None or expected != mlp.padded or loaded.shape[dim] != mlp.original:
        return loaded
    return pad_tail(loaded, dim, mlp.padded)


__all__ = ["pad_heads", "pad_mlp_output", "pad_qkv_shard", "pad_row_input", "pad_tail"]
