"""Start-up check of the ops package: a quantized checkpoint must be one its kernels serve.

Published in the core's entry-point group ``spyre_inference.config_checks``; it
runs in the user's process before an engine starts (see
:mod:`spyre_inference.ops.config_checks` for the group). Without it, an
unsupported method or scheme reaches vLLM's kernel selection inside the engine
and dies there ("Failed to find a kernel that can implement the ScaledMM
linear layer"), naming neither the scheme nor what to serve instead.

Served (:mod:`spyre_inference.ops.quantized_linear`):

* ``compressed-tensors`` with 8-bit groups: FP8 weights (per-tensor or
  per-channel scales) with FP8 activations (dynamic per-token or static
  per-tensor) or none (W8A16); symmetric INT8 weights and activations;
* ``fp8``: an FP8 checkpoint with per-tensor scales, or a 16-bit checkpoint
  quantized when it loads (``--quantization fp8``).

Everything else is refused by name: other methods (AWQ, GPTQ, bitsandbytes,
MXFP4, ...), 4-bit or block-scaled groups, asymmetric activations, any
quantized MoE model (the Spyre expert method is unquantized), and for now any
quantized checkpoint on the card path (the kernels have run on the cpu target
only).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any

from spyre_inference.ops.quantized_linear import SUPPORTED_METHODS
from spyre_inference.platform import device as placement

if TYPE_CHECKING:
    from vllm.config import VllmConfig

_FIX = "serve an unquantized bfloat16/float16/float32 checkpoint"


class QuantizationConfigError(ValueError):
    """A quantized checkpoint the plugin's kernels do not serve."""


def _groups(quant_config: Mapping[str, Any]) -> Iterator[tuple[str, Mapping, Mapping | None]]:
    for name, group in (quant_config.get("config_groups") or {}).items():
        yield name, group.get("weights") or {}, group.get("input_activations")


def _group_problem(weights: Mapping, acts: Mapping | None) -> str | None:
    kind, bits = weights.get("type"), weights.get("num_bits")
    strategy = weights.get("strategy")
    if bits != 8 or kind not in ("float", "int"):
        return f"{bits}-bit {kind} weights"
    if strategy not in ("tensor", "channel"):
        return f"{strategy}-wise weight scales (tensor or channel only)"
    if not weights.get("symmetric", True):
        return "asymmetric weights"
    if acts is None:
        return None if kind == "float" else "INT8 weight-only (W8A16 int)"
    if acts.get("num_bits") != 8 or acts.get("type") != kind:
        return f"{acts.get('num_bits')}-bit {acts.get('type')} activations with {kind} weights"
    if not acts.get("symmetric", True):
        return "asymmetric activations (a zero point)"
    return None


def _is_moe(hf_config: Any) -> bool:
    return any(
        getattr(hf_config, name, None)
        for name in (
            "num_local_experts",
            "num_experts",
            "n_routed_experts",
            "moe_intermediate_size",
        )
    )


def check_quantization(vllm_config: VllmConfig) -> None:
    """Refuse a quantization method or scheme the ops package's kernels do not serve."""
    model_config = vllm_config.model_config
    method = getattr(model_config, "quantization", None)
    if model_config is None or method is None:
        return
    where = f"quantization={method!r} (--quantization, or the checkpoint's quantization_config)"
    if method not in SUPPORTED_METHODS:
        raise QuantizationConfigError(
            f"{where} is not supported by spyre-inference: it serves "
            f"{', '.join(SUPPORTED_METHODS)} (8-bit FP8 and INT8 schemes). Use one of "
            f"those, or {_FIX}."
        )
    if placement.is_spyre():
        # The kernels compute with torch._scaled_mm / torch._int_mm; on the card
        # path they have not run (not even on the emulated card), and INT8 could
        # not: the spec allows no integer tensors on the device.
        raise QuantizationConfigError(
            f"{where} has not been verified on the Spyre card path (only on the cpu "
            f"target, SPYRE_DEVICE_TARGET=cpu). On the card, {_FIX} (float16)."
        )
    if _is_moe(model_config.hf_text_config):
        raise QuantizationConfigError(
            f"{where} on a mixture-of-experts model: spyre-inference's expert kernels are "
            f"unquantized. Serve the experts unquantized, or {_FIX}."
        )
    quant_config = getattr(model_config.hf_config, "quantization_config", None) or {}
    if not isinstance(quant_config, Mapping):
        quant_config = quant_config.to_dict()
    if method == "fp8" and quant_config.get("weight_block_size"):
        raise QuantizationConfigError(
            f"{where} with block-scaled weights (weight_block_size="
            f"{quant_config['weight_block_size']}): spyre-inference's FP8 kernels take "
            f"per-tensor or per-channel scales. Use such a checkpoint, or {_FIX}."
        )
    if method == "compressed-tensors":
        for name, weights, acts in _groups(quant_config):
            problem = _group_problem(weights, acts)
            if problem:
                raise QuantizationConfigError(
                    f"{where}: group {name!r} uses {problem}, which spyre-inference's "
                    "kernels do not implement (they serve 8-bit FP8 W8A8 / W8A16 and "
                    f"symmetric INT8 W8A8 with tensor or channel scales). {_FIX.capitalize()}."
                )


__all__ = ["QuantizationConfigError", "check_quantization"]


def check_int8_vocab(vllm_config: VllmConfig) -> None:
    """Refuse ``SPYRE_CPU_INT8_VOCAB=1`` where the INT8 vocabulary cannot serve."""
    from spyre_inference.platform import settings

    if not settings.get("SPYRE_CPU_INT8_VOCAB"):
        return
    if placement.is_spyre():
        raise QuantizationConfigError(
            "SPYRE_CPU_INT8_VOCAB=1 is a cpu-target option (INT8 GEMMs on the host); the "
            "card computes in float16 and holds no integer tensors. Unset it on the card."
        )
    if vllm_config.lora_config is not None:
        raise QuantizationConfigError(
            "SPYRE_CPU_INT8_VOCAB=1 with LoRA: vLLM's LoRA wrapper of the logits reads the "
            "LM head's 16-bit weight, which the INT8 vocabulary replaces. Unset "
            "SPYRE_CPU_INT8_VOCAB, or serve without --enable-lora."
        )
