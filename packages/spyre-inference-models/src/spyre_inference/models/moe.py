"""The routed-expert backend vLLM's unquantized MoE oracle leaves to an out-of-tree platform.

On an out-of-tree platform vLLM's ``select_unquantized_moe_backend`` returns
``UnquantizedMoeBackend.OOT``: no kernel, no weight conversion
(``process_weights_after_loading`` returns early, "OOT handles internally"),
and vLLM's own routers call compiled ``vllm._C`` top-k ops that do not exist
here. :class:`SpyreUnquantizedFusedMoEMethod` replaces
``UnquantizedFusedMoEMethod`` through ``CustomOp.register_oot`` and supplies
all three:

* **Routing** (monolithic: the method receives the router logits). The
  ``[tokens, experts]`` logits go to the host in float32, where the softmax
  (or sigmoid) over all experts, the top-k, the renormalisation and any
  model-owned scaling run: a few hundred floats per token, and the top-k
  indices are integers Spyre does not compute with. The result returns to the
  device as float combine weights (all-expert form) or int64 gather indices
  (gathered form).
* **Two expert forms** (:func:`gathered_experts`, :func:`all_expert_experts`):
  the *gathered* form ``index_select``s the ``tokens * top_k`` selected
  experts' weights and runs them as batched matmuls; the *all-expert* form runs
  every expert over every token of the chunk and combines with the dense
  weights (zero for unselected experts). The gathered form reads fewer expert
  weights exactly when ``real_tokens * top_k < num_experts``, which is every
  single-token decode step of a model with ``top_k < num_experts``; prefill
  chunks (and decode batches wide enough to touch every expert anyway) use the
  all-expert form, whose shapes depend only on the padded token bucket.
* **Post-load re-layout** (:func:`relayout_expert_weights`): vLLM's
  ``w13 [E, 2M, H]`` / ``w2 [E, H, M]`` stacks become ``[E, H, 2M']`` /
  ``[E, M', H]``, the layouts both forms contract on (``x @ W``, no
  transposed matmul), one stack at a time so the source stack is freed before
  the next is rebuilt: the device cannot hold both layouts of every expert at
  once. ``M'`` is the per-rank intermediate width rounded up to whole 64-element
  sticks: under tensor parallelism upstream shards each expert's intermediate
  dimension and a shard can end mid-stick; the widened columns are zero, so
  ``act(0) * 0 = 0`` meets zero ``w2`` rows and changes nothing. MoERunner
  all-reduces the per-rank partial sums as for any unreduced kernel output.

Per-model recipes: a model whose routing is not "softmax/sigmoid over all
experts, top-k, optional renormalisation" (vLLM passes such models a
``custom_routing_function``) or that owns extra scaling attaches a
:class:`MoeRecipe` to its expert layers with :func:`set_moe_recipe` (see
``configure_gemma4_moe_layers`` in :mod:`spyre_inference.models.gemma4`).

vLLM reaches the experts through its opaque ``moe_forward`` custom op, so this
dispatch runs eagerly inside a block's compiled graph, like attention.
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Callable
from typing import TYPE_CHECKING, Literal

import torch
import torch.nn.functional as F
from torch import nn
from vllm.forward_context import get_forward_context, is_forward_context_available
from vllm.model_executor.layers.fused_moe.activation import MoEActivation
from vllm.model_executor.layers.fused_moe.config import FusedMoEConfig
from vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method import (
    UnquantizedFusedMoEMethod,
)
from vllm.model_executor.utils import replace_parameter

from spyre_inference.platform import device as dev
from spyre_inference.platform.layer_swaps import spyre_oot
from spyre_inference.platform.logs import get_logger

if TYPE_CHECKING:
    from vllm.model_executor.layers.fused_moe.routed_experts import RoutedExperts

logger = get_logger(__name__)

#: Attribute of a RoutedExperts layer holding its :class:`MoeRecipe`.
RECIPE_ATTR = "spyre_moe_recipe"
#: Set on a layer once its weights are in the Spyre layout (a second
#: process_weights_after_loading must not transpose them back).
RELAYOUT_FLAG = "_spyre_moe_relayout"
#: The per-rank intermediate width before stick widening.
INTERMEDIATE_ATTR = "_spyre_moe_intermediate"

GATHERED = "gathered"
ALL_EXPERT = "all_expert"

#: ``gated(gate, up) -> [.., M']``: the expert's activation of its two halves.
GatedActivation = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]

#: gpt-oss's clamped SwiGLU; vLLM's fused-MoE kernels fix these two constants
#: for ``swigluoai`` (``fused_moe/activation.py``), as transformers does.
SWIGLU_OAI_ALPHA = 1.702
SWIGLU_OAI_LIMIT = 7.0


def swiglu_oai(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``(clamp(up, -l, l) + 1) * g * sigmoid(alpha * g)``, ``g = clamp(gate, max=l)``.

    Zero in, zero out: the stick-widened columns (zero gate and up) stay zero.
    """
    gate = gate.clamp(max=SWIGLU_OAI_LIMIT)
    up = up.clamp(min=-SWIGLU_OAI_LIMIT, max=SWIGLU_OAI_LIMIT)
    return (up + 1) * (gate * torch.sigmoid(gate * SWIGLU_OAI_ALPHA))


def _glu(act: Callable[[torch.Tensor], torch.Tensor]) -> GatedActivation:
    return lambda gate, up: act(gate) * up


_ACTIVATIONS: dict[MoEActivation, GatedActivation] = {
    MoEActivation.SILU: _glu(F.silu),
    MoEActivation.GELU: _glu(F.gelu),
    MoEActivation.GELU_TANH: _glu(lambda x: F.gelu(x, approximate="tanh")),
    MoEActivation.SWIGLUOAI: swiglu_oai,
}
#: Activations whose checkpoints interleave gate and up rows in ``w13``
#: (``[gate0, up0, gate1, ...]``, gpt-oss); the re-layout separates them.
_INTERLEAVED = frozenset({MoEActivation.SWIGLUOAI})


@dataclasses.dataclass(frozen=True)
class MoeRecipe:
    """How a model routes its tokens to experts, and what scaling it owns.

    The routing is: ``scoring`` over all experts (in float32), top-``k``,
    renormalise the k weights to sum to one if ``renormalize``, multiply by
    ``routed_scaling_factor``, then by ``expert_scale()[expert]`` if the model
    owns a per-expert scale. ``expert_scale`` is called at every step (the
    model's parameter is read where it lives, after weight loading).

    ``external``: the layer's own routing function (vLLM's
    ``custom_routing_function`` signature), used instead of all of the above.
    vLLM's Transformers MoE backend routes with the Hugging Face gate this way
    when it cannot describe the gate with plain fields (HunYuan MoE). Only the
    cpu target takes it (:func:`default_recipe`).
    """

    scoring: Literal["softmax", "sigmoid"] = "softmax"
    renormalize: bool = True
    routed_scaling_factor: float = 1.0
    expert_scale: Callable[[], torch.Tensor] | None = None
    external: Callable[..., tuple[torch.Tensor, torch.Tensor]] | None = None


def default_recipe(layer: RoutedExperts) -> MoeRecipe:
    """The recipe of a layer whose routing vLLM describes with plain fields."""
    name = getattr(layer, "layer_name", type(layer).__name__)
    if layer.custom_routing_function is not None:
        if not dev.is_spyre():
            # cpu-only: the function runs the model's own gate, top-k included, on
            # whatever device its inputs live on; the card computes top-k on the
            # host (no integer tensors on the device), so it needs a recipe.
            return MoeRecipe(external=layer.custom_routing_function)
        fn = layer.custom_routing_function
        fn_name = getattr(getattr(fn, "func", fn), "__qualname__", repr(fn))
        raise NotImplementedError(
            f"{name} routes with a model-specific function ({fn_name}), which computes its "
            "top-k on the device; spyre-inference needs a MoeRecipe for it on the "
            f"{dev.target()} target (set_moe_recipe in the model's adaptation module). "
            "The cpu target (SPYRE_DEVICE_TARGET=cpu) runs it."
        )
    if layer.use_grouped_topk or layer.e_score_correction_bias is not None:
        raise NotImplementedError(
            f"{name} uses grouped top-k or a score-correction bias (DeepSeek-style "
            "routing), which spyre-inference's MoE backend does not implement."
        )
    if layer.scoring_func not in ("softmax", "sigmoid"):
        raise NotImplementedError(f"{name}: scoring function {layer.scoring_func!r}")
    return MoeRecipe(
        scoring=layer.scoring_func,
        renormalize=bool(layer.renormalize),
        routed_scaling_factor=float(layer.routed_scaling_factor),
    )


def set_moe_recipe(module: nn.Module, recipe: MoeRecipe) -> int:
    """Attach ``recipe`` to every routed-expert layer under ``module``; how many."""
    from vllm.model_executor.layers.fused_moe.routed_experts import RoutedExperts

    count = 0
    for sub in module.modules():
        if isinstance(sub, RoutedExperts):
            setattr(sub, RECIPE_ATTR, recipe)
            count += 1
    return count


def route(
    router_logits: torch.Tensor, top_k: int, recipe: MoeRecipe
) -> tuple[torch.Tensor, torch.Tensor]:
    """Host routing: float32 ``[T, E]`` logits -> (``[T, k]`` float32 weights, int64 ids)."""
    logits = router_logits.float()
    if recipe.scoring == "softmax":
        scores = torch.softmax(logits, dim=-1)
    else:
        scores = torch.sigmoid(logits)
    weights, ids = torch.topk(scores, top_k, dim=-1)
    if recipe.renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    if recipe.routed_scaling_factor != 1.0:
        weights = weights * recipe.routed_scaling_factor
    if recipe.expert_scale is not None:
        scale = dev.to_host(recipe.expert_scale(), torch.float32)
        weights = weights * scale[ids]
    return weights, ids.to(torch.int64)


def _gated(h: torch.Tensor, act: GatedActivation, width: int) -> torch.Tensor:
    # The gate and up halves each start on a stick boundary (width is a
    # multiple of 64), so both slices are lowerable on Spyre.
    return act(h[..., :width], h[..., width:])


def all_expert_experts(
    x: torch.Tensor,
    combine: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    act: GatedActivation,
    b13: torch.Tensor | None = None,
    b2: torch.Tensor | None = None,
) -> torch.Tensor:
    """Every expert over every token: ``x [T, H]``, ``combine [T, E]`` -> ``[T, H]``.

    ``w13 [E, H, 2M']``, ``w2 [E, M', H]``, optional biases ``b13 [E, 2M']``,
    ``b2 [E, H]``. Unselected experts have weight 0, so the combine is an exact
    weighted sum of the selected experts' outputs (biases included).
    """
    width = w2.shape[1]
    h = torch.matmul(x.unsqueeze(0), w13)  # [E, T, 2M']
    if b13 is not None:
        h = h + b13.unsqueeze(1)
    y = torch.matmul(_gated(h, act, width), w2)  # [E, T, H]
    if b2 is not None:
        y = y + b2.unsqueeze(1)
    return (y * combine.t().unsqueeze(-1)).sum(dim=0)


def gathered_experts(
    x: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    act: GatedActivation,
    b13: torch.Tensor | None = None,
    b2: torch.Tensor | None = None,
) -> torch.Tensor:
    """Only the selected experts: ``x [n, H]``, ``weights``/``ids [n, k]`` -> ``[n, H]``.

    The ``n * k`` selected expert matrices (and biases) are gathered
    (``index_select`` on the expert axis) and run as one batched matmul per
    projection.
    """
    n, k = ids.shape
    width = w2.shape[1]
    flat = ids.reshape(-1)
    x_rep = x.repeat_interleave(k, dim=0).unsqueeze(1)  # [n*k, 1, H]
    h = torch.bmm(x_rep, w13.index_select(0, flat))  # [n*k, 1, 2M']
    if b13 is not None:
        h = h + b13.index_select(0, flat).unsqueeze(1)
    y = torch.bmm(_gated(h, act, width), w2.index_select(0, flat))  # [n*k, 1, H]
    if b2 is not None:
        y = y + b2.index_select(0, flat).unsqueeze(1)
    y = y.view(n, k, -1) * weights.unsqueeze(-1)
    return y.sum(dim=1)


def _gate_up(t: torch.Tensor, intermediate: int, interleaved: bool):
    """The gate and up halves of a ``[E, 2M, ...]`` stack (rows interleaved or not)."""
    if interleaved:
        return t[:, 0::2], t[:, 1::2]
    return t.split(intermediate, dim=1)


def relayout_expert_weights(layer: nn.Module, intermediate: int, interleaved: bool = False) -> int:
    """``w13 [E, 2M, H]`` -> ``[E, H, 2M']``, ``w2 [E, H, M]`` -> ``[E, M', H]``; returns M'.

    One stack at a time: each new stack replaces its source (whose storage is
    released) before the next is built. ``interleaved``: ``w13``'s gate and up
    rows alternate (gpt-oss); they come out as the usual two halves. Expert
    biases, where the layer has them (``w13_bias [E, 2M]``, ``w2_bias [E, H]``),
    follow their weights: the gate and up halves of ``w13_bias`` widened the
    same way (zero on the widened columns).
    """
    width = dev.round_up(intermediate)
    w13 = layer.w13_weight.data
    num_experts, _, hidden = w13.shape
    new13 = w13.new_zeros(num_experts, hidden, 2 * width)
    gate, up = _gate_up(w13, intermediate, interleaved)
    new13[:, :, :intermediate] = gate.transpose(1, 2)
    new13[:, :, width : width + intermediate] = up.transpose(1, 2)
    del w13, gate, up
    replace_parameter(layer, "w13_weight", new13)
    del new13

    w2 = layer.w2_weight.data
    new2 = w2.new_zeros(num_experts, width, hidden)
    new2[:, :intermediate, :] = w2.transpose(1, 2)
    del w2
    replace_parameter(layer, "w2_weight", new2)

    b13 = getattr(layer, "w13_bias", None)
    if b13 is not None:
        new_b13 = b13.data.new_zeros(num_experts, 2 * width)
        gate_b, up_b = _gate_up(b13.data, intermediate, interleaved)
        new_b13[:, :intermediate] = gate_b
        new_b13[:, width : width + intermediate] = up_b
        replace_parameter(layer, "w13_bias", new_b13)
    return width


def _num_real_tokens(num_tokens: int) -> int:
    """Tokens of this step that are not bucket padding (the runner's padding mask)."""
    if not is_forward_context_available():
        return num_tokens
    is_padding = get_forward_context().is_padding
    if is_padding is None:
        return num_tokens
    # The mask is [real..., padding...] over the padded bucket.
    return num_tokens - int(is_padding[:num_tokens].sum())


@spyre_oot(UnquantizedFusedMoEMethod)
class SpyreUnquantizedFusedMoEMethod(UnquantizedFusedMoEMethod):
    """``UnquantizedFusedMoEMethod`` with host routing and the two Spyre expert forms.

    ``form_counts`` counts, per form, the forward passes this layer ran (tests
    and diagnostics read it; it costs one dict update per layer and step).
    """

    def __init__(self, moe: FusedMoEConfig) -> None:
        super().__init__(moe)
        unsupported = []
        if not moe.is_act_and_mul:
            unsupported.append("non-gated experts")
        if moe.activation not in _ACTIVATIONS:
            unsupported.append(f"activation {moe.activation.value!r}")
        if moe.moe_parallel_config.use_ep:
            unsupported.append("expert parallelism")
        if unsupported:
            raise NotImplementedError(
                "spyre-inference's MoE backend does not implement "
                + ", ".join(unsupported)
                + f" (experts of {moe.num_experts}, top-{moe.experts_per_token})."
            )
        self._act = _ACTIVATIONS[moe.activation]
        self._interleaved = moe.activation in _INTERLEAVED
        self.form_counts: collections.Counter[str] = collections.Counter()

    @property
    def is_monolithic(self) -> bool:
        # Routing happens here (from the router logits), not in vLLM's routers,
        # whose top-k kernels are compiled vllm._C ops.
        return True

    @property
    def supports_eplb(self) -> bool:
        return False

    def process_weights_after_loading(self, layer: RoutedExperts) -> None:
        if getattr(layer, RELAYOUT_FLAG, False):
            return
        if layer.apply_router_weight_on_input:
            raise NotImplementedError(
                f"{layer.layer_name} applies the router weight to the expert input "
                "(Llama 4 style); spyre-inference's MoE backend weights expert outputs only."
            )
        intermediate = layer.w2_weight.shape[-1]
        relayout_expert_weights(layer, intermediate, self._interleaved)
        setattr(layer, INTERMEDIATE_ATTR, intermediate)
        setattr(layer, RELAYOUT_FLAG, True)
        # Fail at load, not at the first request, if the routing is unsupported.
        if getattr(layer, RECIPE_ATTR, None) is None:
            setattr(layer, RECIPE_ATTR, default_recipe(layer))

    def select_form(self, real_tokens: int, top_k: int) -> str:
        """Gathered when the selected experts are fewer reads than all experts."""
        return GATHERED if real_tokens * top_k < self.moe.num_experts else ALL_EXPERT

    def apply_monolithic(
        self,
        layer: RoutedExperts,
        x: torch.Tensor,
        router_logits: torch.Tensor,
        input_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        recipe: MoeRecipe = getattr(layer, RECIPE_ATTR, None) or default_recipe(layer)
        num_tokens = x.shape[0]
        real = _num_real_tokens(num_tokens)
        if real == 0:
            # A warm-up step made only of bucket padding.
            return x.new_zeros(num_tokens, layer.w2_weight.shape[-1])
        top_k = layer.top_k
        if recipe.external is not None:
            # Whole rows in: vLLM's precomputed-routing variant checks its row count.
            ext_weights, ext_ids = recipe.external(
                hidden_states=x,
                gating_output=router_logits,
                topk=top_k,
                renormalize=bool(layer.renormalize),
            )
            weights = dev.to_host(ext_weights[:real], torch.float32)
            ids = dev.to_host(ext_ids[:real]).to(torch.int64)
        else:
            weights, ids = route(dev.to_host(router_logits[:real], torch.float32), top_k, recipe)
        form = self.select_form(real, top_k)
        self.form_counts[form] += 1
        b13 = getattr(layer, "w13_bias", None)
        b2 = getattr(layer, "w2_bias", None)
        if form == GATHERED:
            out = gathered_experts(
                x[:real],
                dev.to_device(weights, x.dtype),
                dev.to_device(ids),
                layer.w13_weight,
                layer.w2_weight,
                self._act,
                b13,
                b2,
            )
            if real == num_tokens:
                return out
            return torch.cat((out, out.new_zeros(num_tokens - real, out.shape[1])))
        # Padding rows keep zero combine weights: their output rows are zero.
        combine = torch.zeros(num_tokens, layer.local_num_experts, dtype=torch.float32)
        combine[:real].scatter_(1, ids, weights)
        return all_expert_experts(
            x,
            dev.to_device(combine, x.dtype),
            layer.w13_weight,
            layer.w2_weight,
            self._act,
            b13,
            b2,
        )


__all__ = [
    "ALL_EXPERT",
    "GATHERED",
    "MoeRecipe",
    "SpyreUnquantizedFusedMoEMethod",
    "all_expert_experts",
    "default_recipe",
    "gathered_experts",
    "relayout_expert_weights",
    "route",
    "set_moe_recipe",
    "swiglu_oai",
]
