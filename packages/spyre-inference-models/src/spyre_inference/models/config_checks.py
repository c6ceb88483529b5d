"""Start-up check of the models package: text generators on vLLM's Transformers backend.

Published in the core's entry-point group ``spyre_inference.config_checks``; the
platform runs it from ``check_and_update_config``, in the user's process, before
an engine starts.

A text generator that vLLM builds with its Transformers backend must be built by
:class:`~spyre_inference.models.transformers_backend.SpyreTransformersForCausalLM`:
only that class replaces Hugging Face's rotary module and ``apply_rotary_pos_emb``
with the Spyre rotation cache, which keeps the original frequencies when the
platform has widened ``head_dim`` to whole sticks. vLLM's other Transformers
backend classes (the MoE, multimodal and MTP ones) are not adapted: with a padded
head they would rotate at the padded width and decode wrong tokens without any
error, so they are refused here by name. Pooling models are not widened and keep
vLLM's classes.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from vllm.config import VllmConfig

#: The module of vLLM's Transformers backend classes.
UPSTREAM_TRANSFORMERS_MODULE = "vllm.model_executor.models.transformers"
#: The module of the Spyre Transformers backend class.
ADAPTED_MODULE = "spyre_inference.models.transformers_backend"


class TransformersBackendConfigError(ValueError):
    """A text generator resolves to a Transformers backend class the plugin has not adapted."""


def _has_hf_rotary(model_type: str) -> bool:
    """Whether transformers' modeling module for ``model_type`` defines a rotary embedding.

    :class:`~spyre_inference.models.transformers_backend.SpyreTransformersForCausalLM`
    replaces the model's ``*RotaryEmbedding`` modules; a model with learned absolute
    positions (GPT-BigCode, ...) has none, and its attention sizes its heads from
    ``hidden_size`` rather than the widened ``head_dim``.
    """
    import importlib

    try:
        modeling = importlib.import_module(
            f"transformers.models.{model_type}.modeling_{model_type}"
        )
    except ImportError:
        return True  # Not a transformers model type: vLLM's own checks speak for it.
    return any(name.endswith("RotaryEmbedding") for name in vars(modeling))


def check_transformers_backend(vllm_config: VllmConfig) -> None:
    """Refuse a text generator vLLM would build with an unadapted Transformers class."""
    model_config = vllm_config.model_config
    if model_config is None or getattr(model_config, "runner_type", None) != "generate":
        return
    from vllm.model_executor.models.registry import ModelRegistry

    arch = model_config.architecture
    entry = ModelRegistry.models.get(arch)
    module = getattr(entry, "module_name", "")
    name = ", ".join(model_config.architectures or ()) or arch
    if name != arch:
        name = f"{name} (resolved to {arch})"
    if module == ADAPTED_MODULE:
        model_type = getattr(model_config.hf_text_config, "model_type", "")
        if model_type and not _has_hf_rotary(model_type):
            raise TransformersBackendConfigError(
                f"{name} has no rotary position embedding (transformers' {model_type} "
                "model defines none): spyre-inference serves models through vLLM's "
                "Transformers backend with the Spyre rotation cache, which needs RoPE. "
                "Serve a RoPE model, or one vLLM implements natively"
            )
        return
    if not module.startswith(UPSTREAM_TRANSFORMERS_MODULE):
        return
    upstream = getattr(entry, "class_name", "?")
    raise TransformersBackendConfigError(
        f"{name} is served by vLLM's Transformers backend class {upstream}, which "
        "spyre-inference has not adapted (only TransformersForCausalLM, the dense text "
        "generator, gets the Spyre rotary embedding; MoE, multimodal and MTP variants run "
        "Hugging Face's own RoPE, which is wrong once head_dim is padded to whole sticks). "
        "Serve a dense text-generation checkpoint, or a model vLLM implements natively "
        "(model_impl='vllm')"
    )


__all__ = [
    "UPSTREAM_TRANSFORMERS_MODULE",
    "TransformersBackendConfigError",
    "check_transformers_backend",
]
