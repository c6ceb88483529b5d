"""Start-up rules for models with Mamba (state-space) layers.

The models package computes Mamba2 mixers in PyTorch
(``spyre_inference.models.mamba2``) and vLLM's hybrid KV-cache manager keeps
their states beside the attention pages. What that covers is checked here, in
the user's process, so anything else is refused by name before an engine
starts instead of failing inside it on a kernel this platform lacks (vLLM's
Mamba layers call Triton, or ``vllm._C`` on its own CPU platform).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from spyre_inference.platform import discovery

if TYPE_CHECKING:
    from vllm.config import VllmConfig

#: Architectures whose Mamba layers are vLLM's ``MambaMixer2`` and have been
#: checked against transformers on the cpu target.
VERIFIED_ARCHITECTURES = ("GraniteMoeHybridForCausalLM",)


def has_mamba_layers(vllm_config: VllmConfig) -> bool:
    """Whether the model keeps a recurrent state (hybrid or attention-free)."""
    model_config = vllm_config.model_config
    if model_config is None:
        return False
    return bool(model_config.is_hybrid or model_config.is_attention_free)


def mamba_problems(vllm_config: VllmConfig) -> list[str]:
    """What of this configuration the Mamba support does not cover (empty: all of it)."""
    if not has_mamba_layers(vllm_config):
        return []
    model_config = vllm_config.model_config
    architectures = list(model_config.architectures or ())
    name = ", ".join(architectures) or model_config.model
    problems = []
    if not set(architectures) & set(VERIFIED_ARCHITECTURES):
        problems.append(
            f"{name} has Mamba (state-space) layers, and spyre-inference serves those of "
            f"{', '.join(VERIFIED_ARCHITECTURES)} only (Mamba2 mixers, verified against "
            "transformers); serve a transformer model or one of those"
        )
        return problems
    if not discovery.general_plugin_enabled("spyre_models"):
        problems.append(
            f"{name}'s Mamba2 layers are computed by spyre-inference-models, which is not "
            "loaded: install it (and keep spyre_models in VLLM_PLUGINS)"
        )
    if vllm_config.cache_config.mamba_cache_mode != "none":
        problems.append(
            f"prefix caching with Mamba layers (mamba_cache_mode="
            f"{vllm_config.cache_config.mamba_cache_mode!r}) is not supported: the Mamba2 "
            "mixers keep one state per request, not per cached block. Pass "
            "--no-enable-prefix-caching (enable_prefix_caching=False)"
        )
    parallel = vllm_config.parallel_config
    if parallel.tensor_parallel_size > 1 or parallel.pipeline_parallel_size > 1:
        problems.append(
            f"tensor/pipeline parallelism with Mamba layers (--tensor-parallel-size "
            f"{parallel.tensor_parallel_size}, --pipeline-parallel-size "
            f"{parallel.pipeline_parallel_size}) has not been verified: serve {name} on one "
            "rank"
        )
    if vllm_config.speculative_config is not None:
        problems.append(
            "speculative decoding with Mamba layers is not supported (the mixers take one "
            "token per decode step); remove --speculative-config"
        )
    if vllm_config.scheduler_config.disable_hybrid_kv_cache_manager:
        problems.append(
            "--disable-hybrid-kv-cache-manager: Mamba layers keep their states in vLLM's "
            "hybrid KV-cache manager; remove the flag"
        )
    return problems


def choose_kv_cache_manager(vllm_config: VllmConfig) -> str | None:
    """Hybrid KV-cache manager for Mamba models only; everything else keeps one group.

    The platform reports hybrid KV-cache support (vLLM asks before it knows the
    model) because Mamba states need it. Sliding-window and full-attention
    layers stay in one group as before: the attention backends treat a window
    as a mask over a full-length page table, which is what they are verified
    with. Returns the problem when the user asked for the hybrid manager on
    another model (None: decided).
    """
    scheduler = vllm_config.scheduler_config
    if has_mamba_layers(vllm_config):
        return None
    if scheduler.disable_hybrid_kv_cache_manager is False:
        return (
            "--enable-hybrid-kv-cache-manager is supported by spyre-inference for models "
            "with Mamba layers only (other models keep one KV-cache group); remove the flag"
        )
    scheduler.disable_hybrid_kv_cache_manager = True
    return None


__all__ = [
    "VERIFIED_ARCHITECTURES",
    "choose_kv_cache_manager",
    "has_mamba_layers",
    "mamba_problems",
]
