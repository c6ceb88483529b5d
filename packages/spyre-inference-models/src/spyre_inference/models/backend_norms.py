"""The Transformers backend's RMSNorms, swapped for the ops package's Spyre bodies.

vLLM's Transformers backend replaces each Hugging Face RMSNorm with
``TPAwareRMSNorm`` or ``TPAwareGemmaRMSNorm`` (``transformers/fusers/rms_norm.py``):
subclasses of vLLM's norms that all-gather a tensor-parallel-sharded input
first. vLLM's out-of-tree registry swaps a layer by its exact class name, so
the ops package's ``SpyreRMSNorm`` and ``SpyreGemmaRMSNorm`` never reach these
subclasses. Without this module a Q/K norm over a whole projection (OLMo 2,
FlexOlmo) of a stick-padded head failed to load its checkpoint-width weight,
and Gemma-style norms ran upstream's float32 body, which Spyre cannot lower
(``spyre_inference.ops.gemma_norm``).

Each class here is the TP-aware upstream class with the Spyre norm as its
next base: upstream's gather runs first, then the Spyre body. Importing the
module registers the swaps; :mod:`spyre_inference.models.transformers_backend`
imports it, which vLLM does before it builds a backend model.
"""

from __future__ import annotations

from vllm.model_executor.models.transformers.fusers.rms_norm import (
    TPAwareGemmaRMSNorm,
    TPAwareRMSNorm,
)

from spyre_inference.ops.gemma_norm import SpyreGemmaRMSNorm
from spyre_inference.ops.head_norm import SpyreRMSNorm
from spyre_inference.platform.layer_swaps import spyre_oot


@spyre_oot(TPAwareRMSNorm)
class SpyreTPAwareRMSNorm(TPAwareRMSNorm, SpyreRMSNorm):
    """``TPAwareRMSNorm`` with ``SpyreRMSNorm``'s body (exact on padded heads)."""


@spyre_oot(TPAwareGemmaRMSNorm)
class SpyreTPAwareGemmaRMSNorm(TPAwareGemmaRMSNorm, SpyreGemmaRMSNorm):
    """``TPAwareGemmaRMSNorm`` with ``SpyreGemmaRMSNorm``'s activation-dtype body."""


__all__ = ["SpyreTPAwareGemmaRMSNorm", "SpyreTPAwareRMSNorm"]
