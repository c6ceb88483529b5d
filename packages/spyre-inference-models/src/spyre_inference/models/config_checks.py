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


class TransformersBackendConfigError(ValueError):
    """A text generator resolves to a Transformers backend class the plugin has not adapted."""


def check_transformers_backend(vllm_config: VllmConfig) -> None:
    """Refuse a text generator vLLM would build with an unadapted Transformers class."""
    model_config = vllm_config.model_config
    if model_config is None or getattr(model_config, "runner_type", None) != "generate":
        return
    from vllm.model_executor.models.registry import ModelRegistry

    arch = model_config.architecture
    entry = ModelRegistry.models.get(arch)
    module = getattr(entry, "module_name", "")
    if not module.startswith(UPSTREAM_TRANSFORMERS_MODULE):
        return
    upstream = getattr(entry, "class_name", "?")
    raise TransformersBackendConfigError(
        f"{arch} is served by vLLM's Transformers backend class {upstream}, which "
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
