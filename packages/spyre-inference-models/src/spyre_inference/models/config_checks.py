"""Start-up checks of the models package: text generators on vLLM's Transformers backend,
and mixture-of-experts routing the Spyre MoE method computes.

Published in the core's entry-point group ``spyre_inference.config_checks``; the
platform runs it from ``check_and_update_config``, in the user's process, before
an engine starts.

A text generator that vLLM builds with its Transformers backend must be built by
one of the Spyre backend classes (:mod:`spyre_inference.models.transformers_backend`,
dense and MoE): only those replace Hugging Face's rotary module and
``apply_rotary_pos_emb`` with the Spyre rotation cache, which keeps the original
frequencies when the platform has widened ``head_dim`` to whole sticks. vLLM's
other Transformers backend classes (the multimodal and MTP ones) are not
adapted: with a padded head they would rotate at the padded width and decode
wrong tokens without any error, so they are refused here by name. Pooling
models are not widened and keep vLLM's classes. A model whose config lists
layers that are not attention (``layer_types``: Bamba's ``linear_attention``,
Lfm2's ``conv``) is refused as well: vLLM's Transformers backend serves only
layers that go through its attention interface, and would raise building the
model, in the engine process.
So is a head the platform widens but the HF attention sizes itself
(GPT-NeoX derives ``hidden_size // num_attention_heads``; the engine died
tracing it), probed by building one attention module on the meta device.

:func:`check_moe_routing`: the Spyre MoE method weights each expert's *output* by
its router weight. Llama 4 (and Laguna when its config says so) weight the
expert's *input* instead; the method refuses that when it loads the weights, in
the engine process, so the configuration is refused here by name first.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from types import ModuleType

    from vllm.config import VllmConfig

#: The module of vLLM's Transformers backend classes.
UPSTREAM_TRANSFORMERS_MODULE = "vllm.model_executor.models.transformers"
#: The module of the Spyre Transformers backend class.
ADAPTED_MODULE = "spyre_inference.models.transformers_backend"


class TransformersBackendConfigError(ValueError):
    """A text generator resolves to a Transformers backend class the plugin has not adapted."""


#: ``layer_types`` entries of HF configs that are attention layers.
ATTENTION_LAYER_TYPES = frozenset(
    {"attention", "full_attention", "sliding_attention", "chunked_attention"}
)


def _non_attention_layers(text_config: object) -> list[str]:
    layer_types = getattr(text_config, "layer_types", None) or ()
    return sorted({str(t) for t in layer_types} - ATTENTION_LAYER_TYPES)


#: The forward signatures (after ``self``) of the HF rotary modules the Spyre
#: Transformers backend replaces: one frequency set, or one per layer type (OLMo 3).
PER_LAYER_TYPE_SIGNATURE = ("x", "position_ids", "layer_type")
REPLACEABLE_ROTARY_SIGNATURES = (("x", "position_ids"), PER_LAYER_TYPE_SIGNATURE)


def _hf_modeling(model_type: str) -> ModuleType | None:
    """transformers' modeling module of ``model_type``, or ``None`` when it has none."""
    import importlib

    try:
        return importlib.import_module(f"transformers.models.{model_type}.modeling_{model_type}")
    except ImportError:
        return None


def hf_rotary_signatures(model_type: str) -> dict[str, tuple[str, ...]] | None:
    """transformers' ``*RotaryEmbedding`` classes for ``model_type`` -> their forward parameters.

    :class:`~spyre_inference.models.transformers_backend.SpyreTransformersForCausalLM`
    replaces the model's rotary modules; a model with learned absolute positions
    (GPT-BigCode, ...) has none, and nothing is replaced (its attention sizes its
    heads from ``hidden_size``, so a head that needs padding is refused by
    :func:`_padded_head_problem`); a per-layer-type rotary (OLMo 3's
    ``forward(x, position_ids, layer_type)``) is replaced per type.
    ``None`` when transformers has no modeling module of that name.
    """
    import inspect

    modeling = _hf_modeling(model_type)
    if modeling is None:
        return None
    return {
        name: tuple(inspect.signature(cls.forward).parameters)[1:]
        for name, cls in vars(modeling).items()
        if name.endswith("RotaryEmbedding") and isinstance(cls, type)
    }


def _rotary_problem(name: str, model_type: str) -> str | None:
    signatures = hf_rotary_signatures(model_type)
    if signatures is None:
        return None  # Not a transformers model type: vLLM's own checks speak for it.
    if not signatures:
        return None  # No RoPE (learned absolute positions): nothing to replace.
    other = {c: p for c, p in signatures.items() if p not in REPLACEABLE_ROTARY_SIGNATURES}
    if other:
        cls, params = next(iter(other.items()))
        return (
            f"{name}: its rotary embedding {cls} takes forward{params}, which the Spyre "
            "Transformers backend does not replace (it replaces forward(x, position_ids) "
            "and forward(x, position_ids, layer_type)). Serve a model vLLM implements "
            "natively"
        )
    return None


def _hf_attention_head_size(model_type: str, text_config: object, head_dim: int) -> int | None:
    """The head size transformers' attention module of ``model_type`` takes when the
    config says ``head_dim`` (built on the meta device: no memory, no weights).

    Most read ``config.head_dim``; some (GPT-NeoX) derive ``hidden_size //
    num_attention_heads`` themselves, which the platform's widening cannot reach.
    ``None`` when no attention class can be built this way (nothing to tell).
    """
    import copy
    import inspect

    import torch
    from torch import nn

    modeling = _hf_modeling(model_type)
    if modeling is None:
        return None
    config = copy.deepcopy(text_config)
    config.head_dim = head_dim
    for name, cls in vars(modeling).items():
        if not name.endswith("Attention") or not isinstance(cls, type):
            continue
        if not issubclass(cls, nn.Module):
            continue
        params = inspect.signature(cls.__init__).parameters
        if "config" not in params:
            continue
        kwargs = {"layer_idx": 0} if "layer_idx" in params else {}
        try:
            with torch.device("meta"):
                module = cls(config, **kwargs)
        except Exception:  # A class this probe cannot build tells nothing.
            continue
        for attr in ("head_dim", "head_size"):
            size = getattr(module, attr, None)
            if isinstance(size, int):
                return size
    return None


def _padded_head_problem(name: str, model_type: str, vllm_config: VllmConfig) -> str | None:
    """Why the Spyre backend class cannot serve this model once its head is widened."""
    from spyre_inference.platform import stick_pad
    from spyre_inference.platform.device import round_up

    original = stick_pad.head_dim_to_pad(vllm_config)
    if original is None:
        return None
    padded = round_up(original)
    text_config = vllm_config.model_config.hf_text_config
    built = _hf_attention_head_size(model_type, text_config, padded)
    if built is not None and built != padded:
        return (
            f"{name}: transformers' {model_type} attention sizes its heads itself ({built}) "
            f"instead of reading config.head_dim, so spyre-inference cannot widen its "
            f"{original}-wide heads to whole 64-element sticks ({padded}) through vLLM's "
            "Transformers backend. Serve a checkpoint whose head_dim is a multiple of 64, "
            "or a model vLLM implements natively"
        )
    for params in stick_pad.rope_parameter_sets(text_config):
        width = stick_pad.partial_rotary_width(params, text_config, original)
        if width is not None and width > original // 2:
            # HF attention modules that slice the rotary share off themselves
            # (Phi) take the leading entries of the padded head, where the
            # [x1, 0, x2, 0] layout keeps only the first half of the original.
            return (
                f"{name}: its RoPE rotates {width} of each {original}-wide head, more than "
                f"half, and the head is widened to {padded} (whole 64-element sticks); "
                "through vLLM's Transformers backend spyre-inference serves a partial "
                "rotary share of at most half a widened head. Serve a checkpoint whose "
                "head_dim is a multiple of 64, or a model vLLM implements natively"
            )
    return None


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
    if module.startswith((ADAPTED_MODULE, UPSTREAM_TRANSFORMERS_MODULE)):
        other = _non_attention_layers(model_config.hf_text_config)
        if other:
            raise TransformersBackendConfigError(
                f"{name} has {', '.join(other)} layers (layer_types in config.json), and "
                "vLLM builds it with its Transformers backend, which serves only layers "
                "that go through its attention interface (vLLM would fail building the "
                "model). Serve a model vLLM implements natively"
            )
    if module == ADAPTED_MODULE:
        model_type = getattr(model_config.hf_text_config, "model_type", "")
        problem = _rotary_problem(name, model_type) if model_type else None
        if problem is None and model_type:
            problem = _padded_head_problem(name, model_type, vllm_config)
        if problem:
            raise TransformersBackendConfigError(problem)
        return
    if not module.startswith(UPSTREAM_TRANSFORMERS_MODULE):
        return
    upstream = getattr(entry, "class_name", "?")
    raise TransformersBackendConfigError(
        f"{name} is served by vLLM's Transformers backend class {upstream}, which "
        "spyre-inference has not adapted (only the text generators TransformersForCausalLM "
        "and TransformersMoEForCausalLM get the Spyre rotary embedding; multimodal and MTP "
        "variants run Hugging Face's own RoPE, which is wrong once head_dim is padded to "
        "whole sticks). Serve a text-generation checkpoint, or a model vLLM implements "
        "natively (model_impl='vllm')"
    )


class MoeRoutingConfigError(ValueError):
    """The model routes its experts in a way the Spyre MoE method does not compute."""


#: vLLM 0.33 MoE architectures built with ``FusedMoE(apply_router_weight_on_input=True)``.
ROUTER_WEIGHT_ON_INPUT_ARCHITECTURES = frozenset(
    {"Llama4ForCausalLM", "Llama4ForConditionalGeneration"}
)


def check_moe_routing(vllm_config: VllmConfig) -> None:
    """Refuse what the Spyre MoE method does not compute, before an engine starts.

    Expert weighting on the input (Llama 4); expert parallelism (each rank holds
    every expert's shard of the intermediate instead: the method's forms
    contract over all experts, ``moe.py``, which refused it building the first
    layer, inside the engine); vLLM's capture of the routed experts
    (``--enable-return-routed-experts``: vLLM's fused-MoE kernels record the
    top-k ids, the Spyre forms route by themselves and record nothing, and the
    engine died on its first step with "auxiliary output worker output is
    missing").
    """
    model_config = vllm_config.model_config
    if model_config is None or model_config.get_num_experts() <= 0:
        return
    archs = set(model_config.architectures or ()) | {model_config.architecture}
    on_input = sorted(archs & ROUTER_WEIGHT_ON_INPUT_ARCHITECTURES)
    if not on_input and getattr(
        model_config.hf_text_config, "moe_apply_router_weight_on_input", False
    ):
        on_input = sorted(archs)
    if on_input:
        raise MoeRoutingConfigError(
            f"{on_input[0]} multiplies each expert's input by its router weight; the "
            "spyre-inference MoE method (the models package) weights expert outputs, which "
            "is a different computation for these models. Serve a mixture-of-experts model "
            "that weights expert outputs (Mixtral, Qwen3-MoE, Granite MoE, gpt-oss, Gemma 4)"
        )
    if vllm_config.parallel_config.enable_expert_parallel:
        raise MoeRoutingConfigError(
            "--enable-expert-parallel is not supported by spyre-inference's MoE method: it "
            "splits each expert's intermediate over the --tensor-parallel-size ranks "
            "instead, every rank holding every expert. Remove --enable-expert-parallel"
        )
    aux = getattr(vllm_config, "aux_output_config", None)
    if aux is not None and aux.enable_return_routed_experts:
        raise MoeRoutingConfigError(
            "--enable-return-routed-experts is not supported by spyre-inference: vLLM "
            "records the routed experts inside its fused-MoE kernels, and the Spyre MoE "
            "method routes by itself without them. Remove --enable-return-routed-experts"
        )


__all__ = [
    "PER_LAYER_TYPE_SIGNATURE",
    "REPLACEABLE_ROTARY_SIGNATURES",
    "ROUTER_WEIGHT_ON_INPUT_ARCHITECTURES",
    "UPSTREAM_TRANSFORMERS_MODULE",
    "MoeRoutingConfigError",
    "TransformersBackendConfigError",
    "check_moe_routing",
    "check_transformers_backend",
    "hf_rotary_signatures",
]
