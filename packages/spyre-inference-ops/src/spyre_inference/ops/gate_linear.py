"""The MoE router gate, with logits in the weight dtype.

vLLM's ``GateLinear`` may produce float32 router logits (``out_dtype``) or keep
float32 weights (``force_fp32_compute``) so routing is computed at full
precision. Spyre cannot restickify float32 (``spyre::ReStickifyOpHBM`` is
unsupported for IEEE_FP32), so the Spyre gate stays in the model dtype: the
requested dtype is remembered (``requested_out_dtype``) but never applied, and
the MoE backend promotes its stick-aligned softmax reductions itself.

The gate keeps upstream's ``[out, in]`` weight (no transposed fast path): some
vLLM MoE runners read ``gate.weight`` directly, and a router GEMM is small.
"""

from __future__ import annotations

import torch
from vllm.model_executor.layers.fused_moe.router.gate_linear import GateLinear
from vllm.model_executor.layers.quantization import QuantizationConfig

from spyre_inference.platform.layer_swaps import spyre_oot


@spyre_oot(GateLinear)
class SpyreGateLinear(GateLinear):
    """``GateLinear`` whose router logits stay in the weight dtype."""

    def __init__(
        self,
        input_size: int,
        output_size: int,
        bias: bool = False,
        out_dtype: torch.dtype | None = None,
        params_dtype: torch.dtype | None = None,
        force_fp32_compute: bool = False,
        skip_bias_add: bool = False,
        quant_config: QuantizationConfig | None = None,
        prefix: str = "",
        return_bias: bool = True,
    ) -> None:
        # force_fp32_compute would store float32 weights: not a Spyre dtype.
        super().__init__(
            input_size,
            output_size,
            bias=bias,
            out_dtype=None,
            params_dtype=params_dtype,
            force_fp32_compute=False,
            skip_bias_add=skip_bias_add,
            quant_config=quant_config,
            prefix=prefix,
            return_bias=return_bias,
        )
        self.requested_out_dtype = out_dtype
        self.requested_fp32_compute = force_fp32_compute

    def set_out_dtype(self, out_dtype: torch.dtype) -> None:
        """Record the dtype the MoE method asked for; the logits keep the weight dtype."""
        self.requested_out_dtype = out_dtype


__all__ = ["SpyreGateLinear"]
