"""``register_ops``: the ``vllm.general_plugins`` entry point of the ops package.

vLLM calls every general plugin in every process it starts (engine core,
workers, the API server), before any model is built, and may call one more than
once per process; everything here is idempotent. Importing the layer modules
runs their ``@spyre_oot(UpstreamClass)`` decorators, which fill vLLM's
out-of-tree registry; importing :mod:`spyre_inference.ops.convert` registers the
``spyre_convert`` custom op. RoPE registers no op: its gather and rotation are
traced into the compiled graph.
"""

from __future__ import annotations

import importlib
import logging

from spyre_inference.ops._oot import declared_swaps, ensure_registered

logger = logging.getLogger(__name__)

#: Modules whose import declares layer swaps (one concept each).
LAYER_MODULES = (
    "spyre_inference.ops.linear",
    "spyre_inference.ops.lm_head",
    "spyre_inference.ops.logits",
    "spyre_inference.ops.embedding",
    "spyre_inference.ops.rotary",
    "spyre_inference.ops.head_norm",
    "spyre_inference.ops.gemma_norm",
    "spyre_inference.ops.gate_linear",
)
CONVERT_MODULE = "spyre_inference.ops.convert"
QUANTIZED_KERNELS_MODULE = "spyre_inference.ops.quantized_linear"
FP8_OPS_MODULE = "spyre_inference.ops.fp8_quant_ops"

_logged = False


def register_all() -> dict[str, type]:
    """Register every layer swap and the ``spyre_convert`` op; return the swaps."""
    global _logged
    importlib.import_module(CONVERT_MODULE)
    for name in LAYER_MODULES:
        importlib.import_module(name)
    # The 8-bit kernels vLLM's quantized linear methods select from, and the
    # FP8 quantization ops a vLLM built without its _C library lacks.
    importlib.import_module(QUANTIZED_KERNELS_MODULE).register_kernels()
    importlib.import_module(FP8_OPS_MODULE).register_missing()
    # Imports are cached: if vLLM's registry was reset since (tests do), this
    # puts the swaps back; otherwise it only checks them.
    ensure_registered()
    swaps = declared_swaps()
    if not _logged:
        logger.info("spyre-inference layer swaps registered: %s", ", ".join(sorted(swaps)))
        _logged = True
    return swaps


def register_ops() -> None:
    """vLLM general-plugin hook (idempotent)."""
    register_all()


__all__ = ["register_all", "register_ops"]
