"""Gemma's RMSNorm in the activation dtype, with no float32 promotion.

Upstream computes ``x * rsqrt(mean(x^2) + eps)`` in float32 and multiplies by
``1 + w`` in float32 before casting back. Plain ``RMSNorm``'s float32 body
lowers on Spyre, but Gemma's trailing float32 weight multiply does not: the
``[hidden]`` weight is a STANDARD-layout operand that torch-spyre can neither
broadcast against a staggered activation nor de-stagger. The Spyre body keeps
everything in the activation dtype (float16 on the card, bfloat16 by default
on the cpu target), which costs half-precision rounding in the variance and in
``1 + w`` and nothing else.
"""

from __future__ import annotations

from typing import Any

import torch
from vllm.model_executor.layers.layernorm import GemmaRMSNorm

from spyre_inference.ops.head_norm import HeadPaddedNorm
from spyre_inference.platform.layer_swaps import spyre_oot


def gemma_rms_norm_native_dtype(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None = None,
    variance_width: int | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Gemma RMSNorm (``x * rsqrt(mean(x^2) + eps) * (1 + w)``) in ``x.dtype``.

    ``variance_width``: average ``x^2`` over this many lanes instead of all of
    them (a per-head norm of a stick-padded head, whose extra lanes are zero).
    """
    if residual is not None:
        x = x + residual
        residual = x
    if variance_width is None:
        variance = x.pow(2).mean(dim=-1, keepdim=True)
    else:
        variance = x.pow(2).sum(dim=-1, keepdim=True) / variance_width
    out = x * torch.rsqrt(variance + eps) * (1.0 + weight.to(x.dtype))
    return out if residual is None else (out, residual)


@spyre_oot(GemmaRMSNorm)
class SpyreGemmaRMSNorm(HeadPaddedNorm, GemmaRMSNorm):
    """``GemmaRMSNorm`` whose body never leaves the activation dtype.

    Also exact as Gemma 3's per-head ``q_norm``/``k_norm`` of a stick-padded
    head (see :mod:`spyre_inference.ops.head_norm`).
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._watch_head_padding()

    def dispatch_forward(self, compile_native: bool = False) -> Any:
        # vLLM routes a disabled custom op to forward_native (upstream's
        # float32 body); the Spyre body must run whatever custom_ops says.
        del compile_native
        return self.forward_oot

    def forward_oot(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        return gemma_rms_norm_native_dtype(
            x, self.weight, self.variance_epsilon, residual, self.variance_width
        )


__all__ = ["SpyreGemmaRMSNorm", "gemma_rms_norm_native_dtype"]
