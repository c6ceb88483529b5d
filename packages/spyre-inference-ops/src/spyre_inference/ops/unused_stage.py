"""Layers a converted model keeps but never runs: their weights are left alone.

vLLM's pooling adapter (``--convert embed`` / ``classify`` on a causal LM, e.g. a
Qwen3-Embedding checkpoint) builds the model with its LM head wrapped in
``StageMissingLayer``: not a child module, never loaded, never called. vLLM's
post-load loop still finds the head's ``quant_method`` through the wrapper's
attribute forwarding and calls ``process_weights_after_loading`` with the
wrapper, which has no parameters of its own. The Spyre weight methods rebuild
a layer's parameters in that hook (transpose, pack, quantize), so each returns
early for such a layer: there is nothing to prepare for a stage that never runs.
"""

from __future__ import annotations

import torch
from vllm.model_executor.models.utils import StageMissingLayer


def is_unused_stage(layer: torch.nn.Module) -> bool:
    """True for a layer vLLM kept as a placeholder of a stage this model never runs."""
    return isinstance(layer, StageMissingLayer)
