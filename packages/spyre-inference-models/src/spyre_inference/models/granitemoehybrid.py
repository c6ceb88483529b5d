"""GraniteMoeHybrid (Granite 4 hybrid) with its Mamba2 states planned at stick-padded shapes.

vLLM sizes the pages of a hybrid model's KV cache before any layer exists: the
platform's ``update_block_size_for_backend`` asks the *model class* for its
Mamba state shapes (``get_mamba_state_shape_from_config``) and raises the
attention block size until an attention page holds a Mamba page. The layers'
own specs (``SpyreMambaMixer2.get_state_shape``) must then fit that page, so
the class reports the same stick-padded shapes
(:func:`~spyre_inference.models.mamba2.stick_padded_state_shapes`) the mixer
allocates.
"""

from __future__ import annotations

from typing import Any

from vllm.model_executor.models.granitemoehybrid import GraniteMoeHybridForCausalLM

from spyre_inference.models.mamba2 import stick_padded_state_shapes


class SpyreGraniteMoeHybridForCausalLM(GraniteMoeHybridForCausalLM):
    """Upstream's model; only the Mamba state shapes it reports for planning differ."""

    @classmethod
    def get_mamba_state_shape_from_config(
        cls, vllm_config: Any
    ) -> tuple[tuple[int, int], tuple[int, int, int]]:
        return stick_padded_state_shapes(super().get_mamba_state_shape_from_config(vllm_config))


__all__ = ["SpyreGraniteMoeHybridForCausalLM"]
