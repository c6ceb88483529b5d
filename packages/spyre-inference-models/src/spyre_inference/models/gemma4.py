"""Gemma 4: the MoE recipe of its expert blocks (routing and model-owned scaling).

Gemma 4's MoE layers do not route with vLLM's plain fields: vLLM passes the
experts a ``custom_routing_function`` (``Gemma4Router.routing_function``: a
softmax over all experts in float32, top-k, renormalisation over the k, then a
multiplication by the model's learned ``per_expert_scale``), which on CUDA is a
Triton kernel and elsewhere a PyTorch function holding a reference to a device
parameter. The Spyre MoE backend routes on the host from the router logits, so
:func:`configure_gemma4_moe_layers` gives each layer's experts a
:class:`~spyre_inference.models.moe.MoeRecipe` with the same routing and the
per-expert scale read, at every step, from that layer's router parameter.

The router's input preprocessing (weightless RMSNorm, ``hidden_size**-0.5``,
learned per-dimension scale, projection) stays in ``Gemma4Router.forward``,
upstream's module, inside the block graph; only the routing decision moves.
"""

from __future__ import annotations

from torch import nn
from vllm.config import VllmConfig
from vllm.model_executor.models.gemma4 import Gemma4ForCausalLM

from spyre_inference.models.moe import MoeRecipe, set_moe_recipe
from spyre_inference.platform.logs import get_logger

logger = get_logger(__name__)


def _expert_scale_of(router: nn.Module):
    # Read the parameter at call time: weight loading and device placement
    # replace its data after construction.
    return lambda: router.per_expert_scale


def configure_gemma4_moe_layers(model: nn.Module) -> int:
    """Attach the Gemma 4 recipe to every MoE block under ``model``; how many."""
    configured = 0
    for module in model.modules():
        experts = getattr(module, "experts", None)
        router = getattr(module, "router", None)
        if experts is None or router is None or not hasattr(router, "per_expert_scale"):
            continue
        recipe = MoeRecipe(
            scoring="softmax", renormalize=True, expert_scale=_expert_scale_of(router)
        )
        configured += set_moe_recipe(experts, recipe)
    return configured


class SpyreGemma4ForCausalLM(Gemma4ForCausalLM):
    """``Gemma4ForCausalLM`` whose MoE blocks carry the Spyre routing recipe."""

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "") -> None:
        super().__init__(vllm_config=vllm_config, prefix=prefix)
        configured = configure_gemma4_moe_layers(self)
        if configured:
            logger.info("Gemma 4: MoE recipe on %d expert layers", configured)


__all__ = ["SpyreGemma4ForCausalLM", "configure_gemma4_moe_layers"]
