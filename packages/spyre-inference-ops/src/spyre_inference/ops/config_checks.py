"""Start-up check of the ops package: the model's RoPE must be one Spyre's forms can rotate.

Published in the core's entry-point group ``spyre_inference.config_checks``;
the platform runs it from ``check_and_update_config``, in the user's process,
before an engine starts. :class:`~spyre_inference.ops.rotary.SpyreRotaryEmbedding`
refuses the same configurations when a layer is built, but that happens in the
engine process, where the message reaches the user only through the log.

The ops package rotates neox full-head RoPE in its 2x2 form and partial or
interleaved (GPT-J-style) RoPE in its pair form (:mod:`spyre_inference.ops.rotary`).
Two cases remain refused:

* partial rotary on a head that stick padding widens: vLLM derives the rotary
  width from the (widened) head size, so it would rotate the wrong entries;
* interleaved rotary in a model vLLM builds with its Transformers backend:
  there Hugging Face's attention code applies RoPE, and the Spyre replacement
  (the models package) tells neox full-head and partial RoPE from the HF
  rotary module's frequencies, not the pairing.

What the config says about RoPE, read the way vLLM 0.33 reads it:

* partial rotary: ``get_rope`` rotates ``rope_dim`` entries, or
  ``head_size * partial_rotary_factor`` (from the rope parameters, where
  vLLM's ``patch_rope_parameters`` also moves the legacy ``rotary_pct`` /
  ``rotary_emb_fraction`` names), except for Gemma 4's ``proportional`` type,
  which rotates the whole head with the identity on the pairs past the factor;
* interleaved (``is_neox_style=False``): not in the config; each vLLM model
  class passes it. :data:`INTERLEAVED_ROPE_ARCHITECTURES` lists the
  text-generation classes of vLLM 0.33 that always do (ChatGLM does when its
  config sets ``original_rope``).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from spyre_inference.platform import discovery, stick_pad
from spyre_inference.platform.device import STICK_ELEMS

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

#: vLLM's Transformers backend classes live under this module.
_TRANSFORMERS_BACKEND_MODULE = "vllm.model_executor.models.transformers"
_NATIVE_MODULES = "vllm.model_executor.models."


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


def _built_by_vllm(model_config: Any) -> bool:
    """Whether the resolved class is one of vLLM's own models (not its Transformers
    backend, not a plugin's class): those build their RoPE with ``get_rope``."""
    from vllm.model_executor.models.registry import ModelRegistry

    module = getattr(ModelRegistry.models.get(model_config.architecture), "module_name", "")
    return module.startswith(_NATIVE_MODULES) and not module.startswith(
        _TRANSFORMERS_BACKEND_MODULE
    )


def _partial_setting(text_config: Any, head_size: int) -> str | None:
    """How the config asks for partial rotary, or None for a full-head rotation."""
    for params in _rope_parameter_sets(text_config):
        if params.get("rope_type") in FULL_HEAD_PARTIAL_ROPE_TYPES:
            continue
        rope_dim = params.get("rope_dim")
        factor = params.get(
            "partial_rotary_factor", getattr(text_config, "partial_rotary_factor", 1.0)
        )
        if rope_dim is not None and int(rope_dim) != head_size:
            return f"rope_dim={rope_dim} (head_dim {head_size})"
        if rope_dim is None and factor is not None and float(factor) != 1.0:
            return f"partial_rotary_factor={factor}"
    return None


def check_rotary(vllm_config: VllmConfig) -> None:
    """Refuse the RoPE forms the ops package's rotary embedding cannot serve (see above)."""
    model_config = vllm_config.model_config
    if model_config is None or not discovery.general_plugin_enabled("spyre_ops"):
        return  # vLLM's own RoPE runs (no swap, no restriction)
    text_config = model_config.hf_text_config
    archs = _architectures(model_config)
    interleaved = archs & INTERLEAVED_ROPE_ARCHITECTURES
    if not interleaved and archs & _CHATGLM_ARCHITECTURES:
        if getattr(text_config, "original_rope", False):
            interleaved = archs & _CHATGLM_ARCHITECTURES
    head_size = model_config.get_head_size()
    partial = _partial_setting(text_config, head_size)
    if not (interleaved or partial):
        return
    what = (
        f"{partial} in the model's rope parameters (config.json) rotates only part of each "
        "head (partial rotary)"
        if partial
        else f"architecture {sorted(interleaved)[0]} (the model's config.json) builds its "
        "rotary embedding GPT-J-style (interleaved pairs)"
    )
    if interleaved and not _built_by_vllm(model_config):
        raise RotaryConfigError(
            f"{what}, and vLLM builds {model_config.architecture} with its Transformers "
            "backend, where spyre-inference's rotary replacement handles neox-style RoPE "
            "only. Serve a model vLLM implements natively (model_impl='vllm'), or one with "
            "neox-style RoPE."
        )
    if partial and stick_pad.head_dim_to_pad(vllm_config) is not None:
        raise RotaryConfigError(
            f"{what}, and head_dim {head_size} is not a whole number of "
            f"{STICK_ELEMS}-element sticks: the plugin widens such heads, and vLLM would "
            "derive the rotary width from the widened head. Serve a checkpoint whose "
            f"head_dim is a multiple of {STICK_ELEMS}, or one with full-head RoPE."
        )


__all__ = ["INTERLEAVED_ROPE_ARCHITECTURES", "RotaryConfigError", "check_rotary"]
