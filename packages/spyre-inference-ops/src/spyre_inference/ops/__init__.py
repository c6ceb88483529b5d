"""Spyre layer swaps for vLLM.

``register_ops`` (the ``vllm.general_plugins`` entry point) registers every
swap with vLLM's ``register_oot`` and the ``spyre_convert`` custom op. The layer
classes are importable from here for inspection and tests; importing this
package alone does not import vLLM's layers (vLLM loads general plugins early,
and the swaps are registered only when ``register_ops`` runs).
"""

from __future__ import annotations

import importlib
from typing import Any

from spyre_inference.ops._version import __version__

#: Every layer swap the package declares: Spyre class -> defining module. The one
#: list of the package's swaps: ``register`` imports exactly these modules (whose
#: ``@spyre_oot`` decorators register them), and a test holds the decorators to it.
LAYER_SWAPS: dict[str, str] = {
    "SpyreColumnParallelLinear": "linear",
    "SpyreMergedColumnParallelLinear": "linear",
    "SpyreQKVParallelLinear": "linear",
    "SpyreReplicatedLinear": "linear",
    "SpyreRowParallelLinear": "linear",
    "SpyreParallelLMHead": "lm_head",
    "SpyreLogitsProcessor": "logits",
    "SpyreVocabParallelEmbedding": "embedding",
    "SpyreRotaryEmbedding": "rotary",
    "SpyreLlama3RotaryEmbedding": "rotary",
    "SpyreYaRNScalingRotaryEmbedding": "rotary",
    "SpyreLinearScalingRotaryEmbedding": "rotary",
    "SpyreNTKScalingRotaryEmbedding": "rotary",
    "SpyreDynamicNTKScalingRotaryEmbedding": "rotary",
    "SpyreDynamicNTKAlphaRotaryEmbedding": "rotary",
    "SpyreGemma4RotaryEmbedding": "rotary",
    "SpyrePhi3LongRoPEScaledRotaryEmbedding": "rotary",
    "SpyreGemmaRMSNorm": "gemma_norm",
    "SpyreRMSNorm": "head_norm",
    "SpyreGateLinear": "gate_linear",
}

#: Public name -> defining module (imported on first access). Even ``register_ops``
#: (the entry point) is resolved lazily: the core imports this package early, from
#: inside vLLM's own import of ``vllm.config``, to read the package's settings
#: (``spyre_inference.ops.settings``), when vLLM's layers cannot be imported yet.
_EXPORTS = {
    "register_all": "register",
    "register_ops": "register",
    "SpyreTransposedWeightMethod": "transposed_weight",
    "SpyreUnquantizedLinearMethod": "transposed_weight",
    "install_transposed_method": "transposed_weight",
    "spyre_linear_t": "transposed_weight",
    "SpyreUnquantizedLMHeadMethod": "lm_head",
    "spyre_convert": "convert",
    **LAYER_SWAPS,
}


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{module}"), name)


__all__ = ["LAYER_SWAPS", "__version__", *sorted(_EXPORTS)]
