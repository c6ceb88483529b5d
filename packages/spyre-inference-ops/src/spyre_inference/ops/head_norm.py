"""Per-head and per-projection Q/K norms at a stick-padded head width.

Qwen3 and Gemma 3 normalise each head (``q_norm``/``k_norm`` of ``head_dim``);
OLMo 2, OLMoE and FlexOlmo normalise the whole Q or K projection (a norm of
``num_heads * head_dim``).

When the platform widens ``head_dim`` to a whole 64-element stick
(:mod:`spyre_inference.platform.stick_pad`), a norm applied to each head is built
at the padded width while the checkpoint holds the original one. Two things must
then stay exact:

* the weight: padded in the same ``[w1, 0, w2, 0]`` layout as the Q/K heads it
  scales (:func:`~spyre_inference.ops.stick_pad_load.pad_heads`), so each weight
  entry still meets its activation and the padded lanes stay zero;
* the variance: the padded lanes of Q/K are zero, so ``sum(x^2)`` is unchanged,
  but ``mean`` would divide by the padded width. The norm divides by the
  original width instead.

Which norms span padded heads is decided when the weight loads: a norm whose
width is ``n`` padded heads *and* whose checkpoint tensor is ``n`` original
heads wide. That is unambiguous even for a model whose ``hidden_size`` is a
multiple of the padded head size (its hidden norms are not widened and load
full-width tensors). Every other norm, and every norm when nothing is padded,
runs upstream's body unchanged.
"""

from __future__ import annotations

from typing import Any

import torch
from vllm.model_executor.layers.layernorm import RMSNorm
from vllm.model_executor.model_loader.weight_utils import default_weight_loader
from vllm.model_executor.utils import set_weight_attrs

from spyre_inference.ops.stick_pad_load import pad_heads
from spyre_inference.platform.layer_swaps import spyre_oot
from spyre_inference.platform.stick_pad import DimPad, current_plan


class HeadPaddedNorm:
    """Mixin: load an original-width weight into a padded per-head norm.

    ``variance_width`` is ``None`` for an ordinary norm and the original width
    (heads x original head size) once a head-laid-out weight has been padded at load.
    """

    variance_width: int | None = None
    _head_pad: DimPad | None = None

    def _watch_head_padding(self) -> None:
        plan = current_plan()
        pad = plan.head_dim if plan is not None else None
        weight = getattr(self, "weight", None)
        if pad is None or not isinstance(weight, torch.nn.Parameter):
            return
        if weight.dim() != 1 or weight.shape[0] % pad.padded:
            return
        self._head_pad = pad
        set_weight_attrs(weight, {"weight_loader": self._load_weight})

    def _load_weight(self, param: torch.nn.Parameter, loaded: torch.Tensor) -> None:
        pad = self._head_pad
        heads = param.shape[0] // pad.padded if pad is not None else 0
        if pad is not None and loaded.dim() == 1 and loaded.shape[0] == heads * pad.original:
            loaded = pad_heads(loaded, 0, pad)
            self.variance_width = heads * pad.original
        default_weight_loader(param, loaded)


def rms_norm_of_width(
    x: torch.Tensor, weight: torch.Tensor | None, eps: float, width: int
) -> torch.Tensor:
    """Upstream's float32 RMSNorm body with ``mean`` taken over ``width`` lanes.

    The lanes beyond ``width`` are zero (padding), so the sum is exact.
    """
    orig_dtype = x.dtype
    x = x.to(torch.float32)
    variance = x.pow(2).sum(dim=-1, keepdim=True) / width
    x = x * torch.rsqrt(variance + eps)
    if weight is not None:
        x = x.to(weight.dtype) * weight
    return x.to(orig_dtype)


@spyre_oot(RMSNorm)
class SpyreRMSNorm(HeadPaddedNorm, RMSNorm):
    """``RMSNorm`` that stays exact as a per-head norm of a stick-padded head."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._watch_head_padding()

    def forward_native(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        width = self.variance_width
        if width is None:
            return super().forward_native(x, residual)
        # Per-head norms (q_norm/k_norm) never take a residual in vLLM's models.
        if residual is not None:
            raise NotImplementedError("a per-head padded RMSNorm takes no residual")
        weight = self.weight.data if self.has_weight else None
        return rms_norm_of_width(x, weight, self.variance_epsilon, width)


__all__ = ["HeadPaddedNorm", "SpyreRMSNorm", "rms_norm_of_width"]
