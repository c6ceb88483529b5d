"""Logits leave the device before anything samples them.

vLLM's sampler starts with ``logits.to(torch.float32)``. On Spyre that cast of
a device tensor crashes torch-spyre's ``copy_from_d2d`` (and float32 is not a
Spyre compute dtype anyway), so the logits processor hands the sampler host
logits: on a single card ``_apply_head`` converts right after the LM-head
matmul; under TP ``_gather_logits`` all-gathers on the device first and converts
the gathered result. Soft-capping, scaling and the vocabulary slice then run on
the host, in the logits' own dtype, exactly as upstream orders them.
"""

from __future__ import annotations

import torch
from vllm.model_executor.layers.logits_processor import LogitsProcessor
from vllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding

from spyre_inference.ops.convert import spyre_convert
from spyre_inference.ops.lm_head import SpyreUnquantizedLMHeadMethod
from spyre_inference.ops.transposed_weight import OUT_FEATURES_ATTR, spyre_linear_t
from spyre_inference.platform.layer_swaps import spyre_oot


@spyre_oot(LogitsProcessor)
class SpyreLogitsProcessor(LogitsProcessor):
    """``LogitsProcessor`` whose logits reach the host before any sampling cast."""

    def _apply_head(
        self,
        lm_head: VocabParallelEmbedding,
        hidden_states: torch.Tensor,
        embedding_bias: torch.Tensor | None,
    ) -> torch.Tensor:
        # Spec ("Device Placement Strategy"): the runner slices
        # hidden_states[logits_indices] on the host; they go back to the device
        # for the LM-head matmul, whose weight lives there.
        hidden_states = spyre_convert(hidden_states, "device")
        head_dtype = self.head_dtype
        if (
            head_dtype is not None
            and head_dtype != hidden_states.dtype
            and isinstance(lm_head.quant_method, SpyreUnquantizedLMHeadMethod)
        ):
            # An explicit head dtype (e.g. float32 for RL consistency) on the
            # transposed head: upstream casts ``lm_head.weight``, which the
            # Spyre head no longer has; cast its transposed matrix instead.
            logits = spyre_linear_t(
                hidden_states.to(head_dtype),
                lm_head.padded_weight_t.to(head_dtype),
                embedding_bias.to(head_dtype) if embedding_bias is not None else None,
                getattr(lm_head, OUT_FEATURES_ATTR, None),
            )
        else:
            logits = super()._apply_head(lm_head, hidden_states, embedding_bias)
        if lm_head.tp_size == 1:
            logits = spyre_convert(logits, "host")
        return logits

    def _gather_logits(self, logits: torch.Tensor) -> torch.Tensor:
        # All-gather (or gather) on the device, then one conversion.
        gathered = super()._gather_logits(logits)
        if gathered is None:
            return gathered
        return spyre_convert(gathered, "host")


__all__ = ["SpyreLogitsProcessor"]
