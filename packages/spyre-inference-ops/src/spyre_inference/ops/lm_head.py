"""The LM head: vocabulary rows padded to 64x32, stored transposed.

The per-rank LM-head weight ``[vocab_per_rank, hidden]`` is zero-padded to a
multiple of ``64 * 32`` rows (whole 64-element sticks across Spyre's 32 cores,
so the vocabulary axis of ``x @ Wt`` splits evenly) and transposed once at load
to ``[hidden, vocab_padded]``. ``apply`` runs the plain matmul and slices the
pad columns off on the device (on a cpu target that computes it on a float32
weight copy, the logits stay float32); the logits stay on the device, so a TP
all-gather runs there (the logits processor moves them to the host after).
"""

from __future__ import annotations

from typing import Any

import torch
from vllm.model_executor.layers.linear import UnquantizedLinearMethod
from vllm.model_executor.layers.vocab_parallel_embedding import (
    ParallelLMHead,
    UnquantizedEmbeddingMethod,
)

from spyre_inference.ops import int8_vocab
from spyre_inference.ops.transposed_weight import SpyreTransposedWeightMethod
from spyre_inference.platform.device import STICK_ELEMS
from spyre_inference.platform.layer_swaps import spyre_oot

#: Spyre has 32 cores; a vocabulary that is a multiple of 32 sticks splits
#: evenly across them.
SPYRE_CORES = 32
LM_HEAD_ROW_ALIGN = STICK_ELEMS * SPYRE_CORES


class SpyreUnquantizedLMHeadMethod(SpyreTransposedWeightMethod, UnquantizedEmbeddingMethod):
    """The transposed-weight fast path with 64x32 row padding, for the LM head.

    The padded, transposed matrix is a new parameter ``padded_weight_t``; the
    head's ``weight`` is dropped after load (with tied embeddings the input
    embedding keeps its own reference to it).
    """

    WEIGHT_T_ATTR = "padded_weight_t"
    ROW_ALIGN = LM_HEAD_ROW_ALIGN
    # Where the cpu target computes the head in float32 anyway, hand the
    # sampler those float32 logits (it casts to float32 first thing) instead
    # of rounding them to bfloat16: bfloat16 logits of ~20 are 0.125 apart, so
    # near-ties between the top tokens become exact ties broken by token id.
    # vLLM's own ``head_dtype`` option shows float32 logits are supported.
    KEEP_GEMM_DTYPE = True


@spyre_oot(ParallelLMHead)
class SpyreParallelLMHead(ParallelLMHead):
    """``ParallelLMHead`` whose unquantized method is :class:`SpyreUnquantizedLMHeadMethod`."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # A quant config that excludes the head hands out the plain linear
        # method instead of the embedding one: both are unquantized weights.
        if type(self.quant_method) in (UnquantizedEmbeddingMethod, UnquantizedLinearMethod):
            if int8_vocab.enabled():
                # cpu target, SPYRE_CPU_INT8_VOCAB=1: the INT8 head (int8_vocab).
                self.quant_method = int8_vocab.SpyreInt8LMHeadMethod()
            else:
                self.quant_method = SpyreUnquantizedLMHeadMethod()

    @property
    def weight(self) -> torch.Tensor:
        """The ``[vocab_padded, hidden]`` weight: the loaded parameter, or after load
        a view of ``padded_weight_t`` (no copy).

        The load drops the parameter for its transposed copy, but vLLM's LoRA
        wrapper of the logits processor (``from_layer_logits_processor``) reads
        ``lm_head.weight`` for the dtype and device of its adapter buffers.
        """
        params = self.__dict__["_parameters"]
        if "weight" in params:
            return params["weight"]
        weight_t = getattr(self, SpyreUnquantizedLMHeadMethod.WEIGHT_T_ATTR, None)
        if weight_t is None:
            raise AttributeError(f"{type(self).__name__} has no weight before it is created")
        return weight_t.t()

    @weight.deleter
    def weight(self) -> None:
        # ``del head.weight`` when the parameter is registered is handled by
        # nn.Module (it removes it from ``_parameters``); once it has been
        # dropped, the view above owns nothing. vLLM's layerwise reload deletes
        # every tensor attribute the layer has before restoring the checkpoint
        # layout, this one included.
        return None


__all__ = ["LM_HEAD_ROW_ALIGN", "SpyreParallelLMHead", "SpyreUnquantizedLMHeadMethod"]
