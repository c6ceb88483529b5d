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

from spyre_inference.ops import LAYER_SWAPS
from spyre_inference.platform import layer_swaps

logger = logging.getLogger(__name__)

PACKAGE = "spyre_inference.ops"
#: Modules whose import declares layer swaps (one concept each), from LAYER_SWAPS.
LAYER_MODULES = tuple(dict.fromkeys(f"{PACKAGE}.{module}" for module in LAYER_SWAPS.values()))
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
    layer_swaps.ensure_registered()
    swaps = layer_swaps.declared_swaps(PACKAGE)
    if not _logged:
        logger.info("spyre-inference layer swaps registered: %s", ", ".join(sorted(swaps)))
        _logged = True
    return swaps


def register_ops() -> None:
    """vLLM general-plugin hook (idempotent)."""
    register_all()


__all__ = ["register_all", "register_ops"]
