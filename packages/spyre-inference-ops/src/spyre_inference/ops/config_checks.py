"""Start-up check of the ops package: the model's RoPE must be one Spyre's form can rotate.

Published in the core's entry-point group ``spyre_inference.config_checks``;
the platform runs it from ``check_and_update_config``, in the user's process,
before an engine starts. :class:`~spyre_inference.ops.rotary.SpyreRotaryEmbedding`
refuses the same configurations when a layer is built, but that happens in the
engine process, where the message reaches the user only through the log.

What the config says about RoPE, read the way vLLM 0.33 reads it:

* partial rotary: ``get_rope`` rotates ``rope_dim`` entries, or
  ``head_size * partial_rotary_factor`` (from the rope parameters, where
  vLLM's ``patch_rope_parameters`` also moves the legacy ``rotary_pct`` /
  ``rotary_emb_fraction`` names), except for Gemma 4's ``proportional`` type,
  which rotates the whole head with the identity on the pairs past the factor;
* interleaved (GPT-J-style, ``is_neox_style=False``): not in the config; each
  vLLM model class passes it. :data:`INTERLEAVED_ROPE_ARCHITECTURES` lists the
  text-generation classes of vLLM 0.33 that always do (ChatGLM does when its
  config sets ``original_rope``). An architecture missing from the list still
  fails when its RoPE layer is built.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from spyre_inference.platform import discovery

if TYPE_CHECKING:
    from vllm.config import VllmConfig

#: vLLM 0.33 architectures whose decoder RoPE is built with ``is_neox_style=False``.
INTERLEAVED_ROPE_ARCHITECTURES = frozenset(
    {
        "GPTJForCausalLM",
        "CohereForCausalLM",
        "Cohere2ForCausalLM",
        "Cohere2MoeForCausalLM",
        "Glm4ForCausalLM",
        "Ernie4_5ForCausalLM",
        "Ernie4_5_MoeForCausalLM",
        "BailingMoeV2_5ForCausalLM",
        "BailingMoeV3ForCausalLM",
    }
)
#: Rope types whose partial factor still rotates the whole head (the pairs past
#: the factor get the identity rotation): Gemma 4's ``proportional``.
FULL_HEAD_PARTIAL_ROPE_TYPES = frozenset({"proportional"})
_CHATGLM_ARCHITECTURES = frozenset({"ChatGLMModel", "ChatGLMForConditionalGeneration"})

_FIX = (
    "spyre-inference's RoPE (the ops package) rotates the two halves of the whole head "
    "(neox style) only; serve a model with neox-style RoPE over the full head "
    "(Llama, Granite, Mistral, Qwen3, Gemma, ...)."
)


class RotaryConfigError(ValueError):
    """The model's RoPE is a form the Spyre rotation cannot express."""


def _rope_parameter_sets(text_config: Any) -> Iterator[dict[str, Any]]:
    """The model's rope parameter dicts (one per layer type when nested, as in Gemma 3)."""
    params = getattr(text_config, "rope_parameters", None)
    if not isinstance(params, dict) or not params:
        return
    if all(isinstance(v, dict) for v in params.values()):
        yield from (v for v in params.values() if v)
    else:
        yield params


def _architectures(model_config: Any) -> set[str]:
    names = set(getattr(model_config.hf_config, "architectures", None) or ())
    names.add(model_config.architecture)
    return names


def check_rotary(vllm_config: VllmConfig) -> None:
    """Refuse interleaved or partial RoPE when the ops package's RoPE will be used."""
    model_config = vllm_config.model_config
    if model_config is None or not discovery.general_plugin_enabled("spyre_ops"):
        return  # vLLM's own RoPE runs (no swap, no restriction)
    text_config = model_config.hf_text_config
    archs = _architectures(model_config)
    interleaved = archs & INTERLEAVED_ROPE_ARCHITECTURES
    if not interleaved and archs & _CHATGLM_ARCHITECTURES:
        if getattr(text_config, "original_rope", False):
            interleaved = archs & _CHATGLM_ARCHITECTURES
    if interleaved:
        raise RotaryConfigError(
            f"architecture {sorted(interleaved)[0]} (the model's config.json) builds its "
            f"rotary embedding GPT-J-style (interleaved, is_neox_style=False). {_FIX}"
        )

    head_size = model_config.get_head_size()
    for params in _rope_parameter_sets(text_config):
        if params.get("rope_type") in FULL_HEAD_PARTIAL_ROPE_TYPES:
            continue
        rope_dim = params.get("rope_dim")
        factor = params.get(
            "partial_rotary_factor", getattr(text_config, "partial_rotary_factor", 1.0)
        )
        if rope_dim is not None and int(rope_dim) != head_size:
            setting = f"rope_dim={rope_dim} (head_dim {head_size})"
        elif rope_dim is None and factor is not None and float(factor) != 1.0:
            setting = f"partial_rotary_factor={factor}"
        else:
            continue
        raise RotaryConfigError(
            f"{setting} in the model's rope parameters (config.json) rotates only part of "
            f"each head (partial rotary). {_FIX}"
        )


__all__ = ["INTERLEAVED_ROPE_ARCHITECTURES", "RotaryConfigError", "check_rotary"]
