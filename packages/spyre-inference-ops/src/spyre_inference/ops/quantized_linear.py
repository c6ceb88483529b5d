"""Kernels for vLLM's 8-bit linear methods on Spyre's platform (FP8 and INT8 W8A8, FP8 W8A16).

vLLM's quantized linear methods (compressed-tensors' ``W8A8Fp8``, ``W8A16Fp8``
and ``W8A8Int8`` schemes, and ``quantization="fp8"``) create and load the 8-bit
weights and their scales themselves, then pick a *kernel* for the product from
per-platform tables in ``vllm.model_executor.kernels.linear``
(``_POSSIBLE_FP8_KERNELS``, ``_POSSIBLE_WFP8A16_KERNELS``,
``_POSSIBLE_INT8_KERNELS``), keyed by ``PlatformEnum``. An out-of-tree platform
has no entry, so every quantized checkpoint died inside the engine with "Failed
to find a kernel that can implement the ScaledMM linear layer".
:func:`register_kernels` adds this module's kernels under ``PlatformEnum.OOT``.
It writes to vLLM's tables because vLLM 0.33 offers no registration call for
linear kernels (layers have ``register_oot``, kernels do not); the write is
confined here, idempotent, and checked by ``tests/test_quantized_linear.py``.

What each kernel keeps of the spec: the weight is stored **transposed,
``[in, out]`` contiguous**, once at load (as every Spyre linear weight), in 8
bits, with float32 scales; activations are quantized per token on the fly
(dynamic schemes) or with the checkpoint's static scale. The product on the cpu
target:

* FP8 W8A8: ``torch._scaled_mm`` of the FP8 operands into float32, then the
  per-token and per-channel scales (vLLM's own PyTorch recipe for channel-wise
  scales, ``ChannelWiseTorchFP8ScaledMMLinearKernel``);
* FP8 W8A16: the activation stays in the model dtype; the weight is widened to
  it and scaled per channel inside the product;
* INT8 W8A8 (symmetric): the exact int8 x int8 -> int32 product
  (:func:`~spyre_inference.ops.host_int8.int8_mm`: the plugin's kernel for a
  few rows, ``torch._int_mm`` / oneDNN for more) and the two scales in float32.

Measured at one row on an AMD EPYC (Zen 4, 2 threads), SmolLM2's shapes: a
bfloat16 GEMM 58-103 us, ``torch._int_mm`` 24-39 us, ``torch._scaled_mm`` on
FP8 1.6-3.7 ms and an FP8 -> bfloat16 widening as slow: PyTorch's CPU FP8 is
reference code, so FP8 here is correct but slow (a warning says so once).

INT8 is refused on the card path: the spec allows no integer tensors on the
device. These kernels are the correct path; their speed against bfloat16 is
issue 25's open part (``benchmarks/``).
"""

from __future__ import annotations

from typing import Any

import torch
from vllm.model_executor.kernels.linear.scaled_mm.ScaledMMLinearKernel import (
    FP8ScaledMMLinearKernel,
    FP8ScaledMMLinearLayerConfig,
    Int8ScaledMMLinearKernel,
    Int8ScaledMMLinearLayerConfig,
)
from vllm.model_executor.layers.quantization.utils.w8a8_utils import convert_to_channelwise
from vllm.model_executor.utils import replace_parameter
from vllm.platforms import PlatformEnum, current_platform

from spyre_inference.ops import host_int8
from spyre_inference.ops.host_int8 import int8_mm
from spyre_inference.platform import device as placement
from spyre_inference.platform.logs import get_logger

logger = get_logger(__name__)

#: The FP8 format vLLM's schemes store (``Platform.fp8_dtype``; e4m3, finite).
FP8_MAX = float(torch.finfo(torch.float8_e4m3fn).max)
INT8_MAX = 127.0


_warned_fp8_speed = False


def _warn_fp8_speed() -> None:
    """Say once per process that FP8 products run on PyTorch's reference path here."""
    global _warned_fp8_speed
    if _warned_fp8_speed or placement.is_spyre():
        return
    _warned_fp8_speed = True
    logger.warning(
        "FP8 weights on the cpu target: PyTorch's CPU FP8 GEMM (torch._scaled_mm) and "
        "FP8->16-bit conversion are reference code, measured ~30x slower than a bfloat16 "
        "GEMM at one row on an AMD EPYC (Zen 4). Results are correct; for speed on a CPU "
        "serve the INT8 W8A8 or the bfloat16 checkpoint."
    )


def _platform_ok(card_allowed: bool) -> tuple[bool, str | None]:
    if not current_platform.is_out_of_tree():
        return False, "a Spyre-platform kernel"
    if not card_allowed and placement.is_spyre():
        return False, "integer tensors cannot live on the Spyre card (spec)"
    return True, None


def _in_out(weight: torch.Tensor, out_features: int, *, arrives_transposed: bool) -> torch.Tensor:
    """The weight as ``[in, out]`` contiguous.

    vLLM's FP8 methods hand their kernel the weight already canonicalised to
    ``(K, N)`` (a transposed view of the checkpoint's ``[out, in]``); its INT8
    scheme hands over the checkpoint's ``[out, in]``. Which one is a property of
    the method, not of the shape (a square projection looks the same either way).
    """
    if not arrives_transposed:
        weight = weight.t()
    if weight.shape[1] != out_features:
        raise ValueError(f"expected an [in, {out_features}] weight, got {tuple(weight.shape)}")
    return weight.contiguous()


def _channel_scales(layer: torch.nn.Module, scale: torch.Tensor, channelwise: bool) -> torch.Tensor:
    """Per-output-channel float32 scales ``[out]`` (a fused layer's per-tensor
    scales expanded over each partition's channels)."""
    if not channelwise and scale.numel() > 1:
        scale = convert_to_channelwise(scale, layer.logical_widths)
    scale = scale.reshape(-1).to(torch.float32)
    if scale.numel() == 1:
        scale = scale.expand(layer.output_size_per_partition).contiguous()
    return scale


def quantize_per_token(
    x: torch.Tensor, qmax: float, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-row quantization: ``(x_q, scale [rows, 1] float32)``.

    A zero row gets scale 1 (not 0: the product stays finite and is zero).
    """
    xf = x.float()
    amax = xf.abs().amax(dim=-1, keepdim=True)
    scale = torch.where(amax > 0, amax / qmax, torch.ones_like(amax))
    if dtype == torch.int8:
        # x * (1 / s), rounded: the order of vLLM's int8 quant kernels.
        q = (xf * (1.0 / scale)).round().clamp(-qmax - 1, qmax)
    else:
        q = (xf / scale).clamp(-qmax, qmax)
    return q.to(dtype), scale


class SpyreFp8ScaledMMKernel(FP8ScaledMMLinearKernel):
    """FP8 weights and FP8 activations (per-tensor or per-channel weight scales;
    dynamic per-token or static per-tensor activation scales)."""

    @classmethod
    def is_supported(cls, compute_capability: int | None = None) -> tuple[bool, str | None]:
        return _platform_ok(card_allowed=True)

    @classmethod
    def can_implement(cls, c: FP8ScaledMMLinearLayerConfig) -> tuple[bool, str | None]:
        group = c.weight_quant_key.scale.group_shape
        if not (group.is_per_tensor() or group.is_per_channel()):
            return False, "per-tensor or per-channel weight scales only (no blocks)"
        return True, None

    def get_output_padding(self) -> int | None:
        # Shapes are already fixed by the runner's token buckets.
        return None

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        _warn_fp8_speed()
        w_name, s_name, _, _ = self.layer_param_names
        out_features = layer.output_size_per_partition
        weight = _in_out(getattr(layer, w_name).data, out_features, arrives_transposed=True)
        channelwise = self.config.weight_quant_key.scale.group_shape.is_per_channel()
        scale = _channel_scales(layer, getattr(layer, s_name).data, channelwise)
        replace_parameter(layer, w_name, weight)
        replace_parameter(layer, s_name, scale)

    def apply_scaled_mm(
        self,
        *,
        A: torch.Tensor,
        B: torch.Tensor,
        out_dtype: torch.dtype,
        As: torch.Tensor,
        Bs: torch.Tensor,
        bias: torch.Tensor | None,
        output_shape: list,
    ) -> torch.Tensor:
        one = torch.ones(1, dtype=torch.float32, device=A.device)
        acc = torch._scaled_mm(A, B, scale_a=one, scale_b=one, out_dtype=torch.float32)
        out = acc * As.reshape(-1, 1).float() * Bs.reshape(1, -1)
        if bias is not None:
            out = out + bias.float()
        return out.to(out_dtype).view(*output_shape)


class SpyreFp8WeightOnlyKernel(FP8ScaledMMLinearKernel):
    """FP8 weights, activations in the model dtype (compressed-tensors W8A16)."""

    @classmethod
    def is_supported(cls, compute_capability: int | None = None) -> tuple[bool, str | None]:
        return _platform_ok(card_allowed=True)

    @classmethod
    def can_implement(cls, c: FP8ScaledMMLinearLayerConfig) -> tuple[bool, str | None]:
        return SpyreFp8ScaledMMKernel.can_implement(c)

    def get_output_padding(self) -> int | None:
        return None

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        SpyreFp8ScaledMMKernel.process_weights_after_loading(self, layer)  # type: ignore[arg-type]

    def apply_weights(
        self, layer: torch.nn.Module, x: Any, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        w_name, s_name, _, _ = self.layer_param_names
        weight, scale = getattr(layer, w_name), getattr(layer, s_name)
        x2 = x.reshape(-1, x.shape[-1])
        out = (x2 @ weight.to(x2.dtype)).float() * scale
        if bias is not None:
            out = out + bias.float()
        return out.to(x.dtype).view(*x.shape[:-1], weight.shape[1])

    def apply_scaled_mm(self, **kwargs: Any) -> torch.Tensor:  # pragma: no cover
        raise AssertionError("apply_weights does not quantize the activation")


class SpyreInt8ScaledMMKernel(Int8ScaledMMLinearKernel):
    """Symmetric INT8 weights and activations (cpu target only)."""

    @classmethod
    def is_supported(cls, compute_capability: int | None = None) -> tuple[bool, str | None]:
        return _platform_ok(card_allowed=False)

    @classmethod
    def can_implement(cls, c: Int8ScaledMMLinearLayerConfig) -> tuple[bool, str | None]:
        if not c.input_symmetric:
            return False, "symmetric activation quantization only (no zero point)"
        return True, None

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        host_int8.dispatch()  # the op's CPU kernel, before any graph calls it
        w_name, s_name, i_s_name, _, _ = self.layer_param_names
        out_features = layer.output_size_per_partition
        weight = _in_out(getattr(layer, w_name).data, out_features, arrives_transposed=False)
        scale = _channel_scales(layer, getattr(layer, s_name).data, self.config.is_channelwise)
        replace_parameter(layer, w_name, weight)
        replace_parameter(layer, s_name, scale)
        if self.config.is_static_input_scheme:
            replace_parameter(layer, i_s_name, getattr(layer, i_s_name).data.max().float())

    def apply_weights(
        self, layer: torch.nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        weight, w_scale, i_scale, _, _ = self._get_layer_params(layer)
        x2 = x.reshape(-1, x.shape[-1])
        if i_scale is None:
            xq, x_scale = quantize_per_token(x2, INT8_MAX, torch.int8)
        else:
            x_scale = i_scale.reshape(1, 1)
            xq = (x2.float() / x_scale).round().clamp(-INT8_MAX - 1, INT8_MAX).to(torch.int8)
        acc = int8_mm(xq, weight)
        out = acc.float() * x_scale * w_scale
        if bias is not None:
            out = out + bias.float()
        return out.to(x.dtype).view(*x.shape[:-1], weight.shape[1])


#: vLLM kernel table (attribute of ``vllm.model_executor.kernels.linear``) -> kernels.
KERNEL_TABLES: dict[str, tuple[type, ...]] = {
    "_POSSIBLE_FP8_KERNELS": (SpyreFp8ScaledMMKernel,),
    "_POSSIBLE_WFP8A16_KERNELS": (SpyreFp8WeightOnlyKernel,),
    "_POSSIBLE_INT8_KERNELS": (SpyreInt8ScaledMMKernel,),
}


def register_kernels() -> None:
    """Give vLLM's kernel selection these kernels for the out-of-tree platform
    (idempotent; another plugin's OOT entries are kept, ours first)."""
    from vllm.model_executor.kernels import linear

    for table_name, kernels in KERNEL_TABLES.items():
        table: dict[PlatformEnum, list[type]] = getattr(linear, table_name)
        current = table.get(PlatformEnum.OOT, [])
        table[PlatformEnum.OOT] = [*kernels, *(k for k in current if k not in kernels)]


#: What the platform lists in ``supported_quantization`` (vLLM's method names).
SUPPORTED_METHODS = ("compressed-tensors", "fp8")

__all__ = [
    "KERNEL_TABLES",
    "SUPPORTED_METHODS",
    "SpyreFp8ScaledMMKernel",
    "SpyreFp8WeightOnlyKernel",
    "SpyreInt8ScaledMMKernel",
    "quantize_per_token",
    "register_kernels",
]
