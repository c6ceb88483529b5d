"""Start-up check of the ops package: the model's RoPE must be one Spyre's forms can rotate.

Published in the core's entry-point group ``spyre_inference.config_checks``;
the platform runs it from ``check_and_update_config``, in the user's process,
before an engine starts. :class:`~spyre_inference.ops.rotary.SpyreRotaryEmbedding`
refuses the same configurations when a layer is built, but that happens in the
engine process, where the message reaches the user only through the log.

The ops package rotates neox full-head RoPE in its 2x2 form and partial or
interleaved (GPT-J-style) RoPE in its pair form (:mod:`spyre_inference.ops.rotary`),
on stick-padded heads too (the platform pins a partial rotary width to the
checkpoint's; ``spyre_inference.platform.stick_pad``). One case remains
refused: interleaved rotary in a model vLLM builds with its Transformers
backend. There Hugging Face's attention code applies RoPE, and the Spyre
replacement (the models package) tells neox full-head and partial RoPE from
the HF rotary module's frequencies, not the pairing.

Whether a model is interleaved (``is_neox_style=False``) is not in the config;
each vLLM model class passes it. :data:`INTERLEAVED_ROPE_ARCHITECTURES` lists
the text-generation classes of vLLM 0.33 that always do (ChatGLM does when its
config sets ``original_rope``).
"""

from __future__ import annotations

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
_CHATGLM_ARCHITECTURES = frozenset({"ChatGLMModel", "ChatGLMForConditionalGeneration"})

#: vLLM's Transformers backend classes live under this module.
_TRANSFORMERS_BACKEND_MODULE = "vllm.model_executor.models.transformers"
_NATIVE_MODULES = "vllm.model_executor.models."


class RotaryConfigError(ValueError):
    """The model's RoPE is a form the Spyre rotation cannot express."""


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


def check_rotary(vllm_config: VllmConfig) -> None:
    """Refuse the RoPE forms the ops package's rotary embedding cannot serve (see above)."""
    model_config = vllm_config.model_config
    if model_config is None or not discovery.general_plugin_enabled("spyre_ops"):
        return  # vLLM's own RoPE runs (no swap, no restriction)
    archs = _architectures(model_config)
    interleaved = archs & INTERLEAVED_ROPE_ARCHITECTURES
    if not interleaved and archs & _CHATGLM_ARCHITECTURES:
        if getattr(model_config.hf_text_config, "original_rope", False):
            interleaved = archs & _CHATGLM_ARCHITECTURES
    if interleaved and not _built_by_vllm(model_config):
        raise RotaryConfigError(
            f"architecture {sorted(interleaved)[0]} (the model's config.json) builds its "
            "rotary embedding GPT-J-style (interleaved pairs), and vLLM builds "
            f"{model_config.architecture} with its Transformers backend, where "
            "spyre-inference's rotary replacement handles neox-style RoPE only. Serve a "
            "model vLLM implements natively (model_impl='vllm'), or one with neox-style RoPE."
        )


__all__ = ["INTERLEAVED_ROPE_ARCHITECTURES", "RotaryConfigError", "check_rotary"]
