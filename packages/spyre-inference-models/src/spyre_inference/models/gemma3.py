"""Gemma 3: its linearly scaled RoPE in the Spyre rotation-cache form.

Everything else Gemma 3 needs on Spyre is a layer swap (ops package): the
``1 + w`` RMSNorm, including the per-head q/k norms, runs in the activation
dtype; the LM head and logits processor apply the final soft-cap on the host;
per-layer sliding windows and ``query_pre_attn_scalar`` reach the attention
backend through vLLM's ``Attention``.

What the layer registry cannot reach is the RoPE of Gemma 3's global
(full-attention) layers in the 4B, 12B and 27B models: their
``rope_scaling`` is ``{"rope_type": "linear", "factor": 8}``, for which vLLM
builds a ``LinearScalingRotaryEmbedding``. The ops package swaps
``RotaryEmbedding`` and ``Llama3RotaryEmbedding`` by class name, so this
subclass would run upstream's ``cos_sin_cache`` chunk-and-concat form. Gemma 3
has no hook for the rotary class (``get_rope`` picks it), so the built
instances are retyped to :class:`SpyreLinearScalingRotaryEmbedding`: same
``__init__``, same ``cos_sin_cache`` (positions already divided by the
factor; cut to ``max_model_len`` rows), plus the
``[max_pos, 2, 2, rotary_dim // 2]`` rotation cache gathered with
``index_select`` and applied as the 2x2 rotation, exactly as the ops package's
RoPE does. The sliding (local) layers use plain RoPE, which the ops
package already swaps.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from vllm.config import VllmConfig
from vllm.model_executor.layers.rotary_embedding import LinearScalingRotaryEmbedding
from vllm.model_executor.models.gemma3 import Gemma3ForCausalLM

from spyre_inference.ops.rotary import rotate_neox_2x2, rotation_cache_from_cos_sin
from spyre_inference.platform.logs import get_logger
from spyre_inference.platform.stick_pad import current_plan

logger = get_logger(__name__)


def _max_model_len() -> int | None:
    from vllm.config import get_current_vllm_config_or_none

    config = get_current_vllm_config_or_none()
    if config is None or config.model_config is None:
        return None
    return int(config.model_config.max_model_len)


class SpyreLinearScalingRotaryEmbedding(LinearScalingRotaryEmbedding):
    """``LinearScalingRotaryEmbedding`` as an index_select + 2x2 rotation.

    Never constructed directly: :meth:`adopt` retypes an instance upstream has
    built (see the module docstring).
    """

    rotation_cache: torch.Tensor

    @classmethod
    def adopt(cls, rope: LinearScalingRotaryEmbedding) -> SpyreLinearScalingRotaryEmbedding:
        """Retype ``rope`` in place and give it its rotation cache."""
        if not rope.is_neox_style or rope.rotary_dim != rope.head_size:
            raise NotImplementedError(
                "spyre-inference supports only neox-style full-head RoPE; got "
                f"head_size={rope.head_size}, rotary_dim={rope.rotary_dim}, "
                f"is_neox_style={rope.is_neox_style}."
            )
        if len(rope.scaling_factors) != 1:
            raise NotImplementedError(
                f"LinearScalingRotaryEmbedding with several scaling factors "
                f"({rope.scaling_factors}, used for LoRA batching) is not supported."
            )
        rope.__class__ = cls
        assert isinstance(rope, cls)
        rope._spyre_build_rotation_cache()
        # CustomOp binds its forward at construction; rebind it to the Spyre body.
        rope._forward_method = rope.forward_oot
        return rope

    def _spyre_build_rotation_cache(self) -> None:
        plan = current_plan()
        pad = plan.head_dim if plan is not None else None
        if pad is not None and self.head_size == pad.padded and pad.padded != pad.original:
            # Built at the padded head size: recompute the frequencies over the
            # original width and give each half's padding the identity rotation.
            padded_dim = self.rotary_dim
            self.rotary_dim = pad.original
            try:
                original = self._compute_cos_sin_cache()
            finally:
                self.rotary_dim = padded_dim
            cos, sin = original.chunk(2, dim=-1)
            extra = (pad.padded - pad.original) // 2
            cos = F.pad(cos, (0, extra), value=1.0)
            sin = F.pad(sin, (0, extra), value=0.0)
            self.cos_sin_cache = torch.cat((cos, sin), dim=-1).to(self.dtype)
        # Upstream tabulates max_position_embeddings * factor positions (a
        # million for Gemma 3 27B); only max_model_len of them can occur.
        rows = _max_model_len()
        if rows is not None and rows < self.cos_sin_cache.shape[0]:
            self.cos_sin_cache = self.cos_sin_cache[:rows].contiguous()
        rotation = rotation_cache_from_cos_sin(self.cos_sin_cache)
        self.register_buffer("rotation_cache", rotation, persistent=False)

    def dispatch_forward(self, compile_native: bool = False) -> Any:
        del compile_native
        return self.forward_oot

    def forward_oot(
        self,
        positions: torch.Tensor,
        query: torch.Tensor,
        key: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        rotation = self.rotation_cache
        if rotation.dtype != query.dtype:
            rotation = rotation.to(query.dtype)
        rotation = rotation.index_select(0, positions.reshape(-1))
        query = rotate_neox_2x2(query, rotation, self.head_size)
        if key is not None:
            key = rotate_neox_2x2(key, rotation, self.head_size)
        return query, key


def adopt_linear_scaling_ropes(model: nn.Module) -> list[str]:
    """Retype every upstream ``LinearScalingRotaryEmbedding`` in ``model``; their names."""
    adopted = []
    for name, module in model.named_modules():
        if type(module) is LinearScalingRotaryEmbedding:
            SpyreLinearScalingRotaryEmbedding.adopt(module)
            adopted.append(name)
    return adopted


class SpyreGemma3ForCausalLM(Gemma3ForCausalLM):
    """``Gemma3ForCausalLM`` whose linearly scaled RoPE uses the Spyre rotation cache."""

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "") -> None:
        super().__init__(vllm_config=vllm_config, prefix=prefix)
        adopted = adopt_linear_scaling_ropes(self)
        if adopted:
            logger.info(
                "Gemma 3: %d linearly scaled rotary embeddings use the Spyre rotation cache",
                len(adopted),
            )


__all__ = [
    "SpyreGemma3ForCausalLM",
    "SpyreLinearScalingRotaryEmbedding",
    "adopt_linear_scaling_ropes",
]
