"""vLLM's Transformers modeling backend with a Spyre rotary embedding.

With ``model_impl="transformers"`` vLLM builds the Hugging Face model class
itself and swaps its linear, norm, GLU and embedding modules for vLLM layers
(its fusers), which the ops package's out-of-tree swaps then pick up like any
other vLLM layer. What upstream leaves to Hugging Face's own code is RoPE:
there is no rotary fuser, so HF's ``rotary_emb`` would derive ``cos``/``sin``
inside the forward from int64 ``position_ids`` (an int->float cast Spyre cannot
lower), and every attention module would rotate with ``rotate_half`` (a
negation, a concat and a half-width slice per head).

:class:`SpyreTransformersForCausalLM` therefore, after upstream has built the
model:

* replaces each HF rotary module with :class:`SpyreHFRotaryEmbedding`, whose
  ``[max_model_len, 2, 2, head_dim // 2]`` rotation cache is computed once on
  the host from the HF module's own frequencies (same formula, same float32
  math, same rounding to the model dtype), so the forward is one
  ``index_select``;
* rebinds each attention module's forward so that its
  ``apply_rotary_pos_emb`` is :func:`spyre_apply_rotary_pos_emb`, a batched
  2x2 matmul per frequency pair instead of ``rotate_half``. The rebinding is
  per instance and changes only the function's global lookup of that one name:
  it is the same per-instance forward replacement upstream's fusers already
  apply to these modules, and no module-level state of transformers changes.

Head-dim stick padding is shared with the native path (the platform widens
``head_dim`` and the ops package's QKV loader pads Q/K per rotary half); the
rotation cache is then rebuilt at the pre-pad frequencies with the identity
rotation on each half's padded entries, as the ops package's RoPE does. A
partial share (Phi-2: 32 of 80) is pinned to the checkpoint's width by the
platform, so the HF module's frequencies are already right and the pair form
maps the pairs into the padded layout.
"""

from __future__ import annotations

import copy
import inspect
import types
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from vllm.config import VllmConfig
from vllm.model_executor.layers.attention_layer_base import AttentionLayerBase
from vllm.model_executor.models.transformers import (
    TransformersForCausalLM,
    TransformersMoEForCausalLM,
)
from vllm.model_executor.models.transformers.base import VLLM_ATTN_ATTR

# Imported for its registrations: the backend's TP-aware norms take the Spyre bodies.
from spyre_inference.models import backend_norms  # noqa: F401
from spyre_inference.models.config_checks import (
    PER_LAYER_TYPE_SIGNATURE,
    REPLACEABLE_ROTARY_SIGNATURES,
)
from spyre_inference.ops.rotary import (
    pad_table_halves,
    pair_rotation_tables,
    rotation_cache_from_cos_sin,
)
from spyre_inference.platform.logs import get_logger
from spyre_inference.platform.stick_pad import DimPad, current_plan

logger = get_logger(__name__)

#: Name of the function HF attention modules call to rotate q and k.
APPLY_ROTARY_NAME = "apply_rotary_pos_emb"
#: RoPE types whose frequencies change with the sequence length at run time;
#: a precomputed cache cannot represent them.
DYNAMIC_ROPE_TYPES = frozenset({"dynamic", "longrope"})


def _rotate_matmul(x: torch.Tensor, rotation: torch.Tensor, unsqueeze_dim: int) -> torch.Tensor:
    """Rotate ``x`` (``[..., D]``) by per-token 2x2 matrices ``rotation`` (``[B, T, 2, 2, D//2]``).

    The two halves of a head form, per frequency ``j``, the vector
    ``(x1[j], x2[j])``; the rotation is a batched ``[2, 2] @ [2, 1]`` matmul
    with the frequency as a batch axis.
    """
    half = x.shape[-1] // 2
    rot = rotation.unsqueeze(unsqueeze_dim).movedim(-1, -3)  # [..., T, half, 2, 2]
    pairs = x.unflatten(-1, (2, half)).movedim(-1, -2).unsqueeze(-1)  # [..., T, half, 2, 1]
    out = torch.matmul(rot, pairs)  # [..., T, half, 2, 1]
    return out.squeeze(-1).movedim(-1, -2).flatten(-2)


def _rotate_pairs(
    x: torch.Tensor, tables: torch.Tensor, partner: torch.Tensor, unsqueeze_dim: int
) -> torch.Tensor:
    """The ops package's pair form on HF's layout: ``x * cos_row + (x @ partner) * sin_row``
    with per-token ``tables`` (``[B, T, 2, D]``).

    GPT-NeoX hands whole heads; Phi's attention slices the rotary share off
    before the call and hands only that: the leading ``width`` entries of the
    rows and partner (neox pairs all lie within it) rotate it.
    """
    rows = tables.unsqueeze(unsqueeze_dim)
    width = x.shape[-1]
    if width != rows.shape[-1]:
        rows, partner = rows[..., :width], partner[:width, :width]
    return x * rows.select(-2, 0) + torch.matmul(x, partner) * rows.select(-2, 1)


def spyre_apply_rotary_pos_emb(
    q: torch.Tensor,
    k: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    unsqueeze_dim: int = 1,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Drop-in for HF's ``apply_rotary_pos_emb`` fed by :class:`SpyreHFRotaryEmbedding`.

    Full-head RoPE: ``cos`` carries the gathered rotation matrices (``[B, T, 2, 2,
    D//2]``) and ``sin`` is the same tensor, not read. Partial RoPE (GPT-NeoX,
    Phi): ``cos`` carries the gathered pair-form rows (``[B, T, 2, D]``) and ``sin``
    the ``[D, D]`` partner permutation, told apart by its two dimensions.
    """
    if sin.dim() == 2:
        return _rotate_pairs(q, cos, sin, unsqueeze_dim), _rotate_pairs(k, cos, sin, unsqueeze_dim)
    return _rotate_matmul(q, cos, unsqueeze_dim), _rotate_matmul(k, cos, unsqueeze_dim)


class SpyreHFRotaryEmbedding(nn.Module):
    """An HF rotary module replaced by a gather from a precomputed rotation cache.

    ``forward(x, position_ids)`` keeps HF's signature and returns the pair the
    attention modules unpack as ``cos, sin``: here both are the gathered
    ``[B, T, 2, 2, D//2]`` rotations, or for partial RoPE the gathered pair-form
    rows and the partner permutation, which only
    :func:`spyre_apply_rotary_pos_emb` consumes.
    """

    rotation_cache: torch.Tensor
    partner: torch.Tensor | None

    def __init__(
        self, cache: torch.Tensor, source: str, partner: torch.Tensor | None = None
    ) -> None:
        super().__init__()
        self.source = source
        self.register_buffer("rotation_cache", cache.contiguous(), persistent=False)
        self.register_buffer("partner", partner, persistent=False)

    def extra_repr(self) -> str:
        return f"replaces={self.source}, cache={tuple(self.rotation_cache.shape)}"

    def forward(
        self, x: torch.Tensor, position_ids: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        rot = self.rotation_cache
        if rot.dtype != x.dtype:
            rot = rot.to(x.dtype)
        gathered = rot.index_select(0, position_ids.reshape(-1))
        gathered = gathered.view(*position_ids.shape, *rot.shape[1:])
        if self.partner is not None:
            return gathered, self.partner.to(gathered.dtype)
        return gathered, gathered


class SpyreHFLayerTypeRotaryEmbedding(nn.Module):
    """An HF rotary module with one frequency set per layer type (OLMo 3:
    ``forward(x, position_ids, layer_type)``), replaced by one
    :class:`SpyreHFRotaryEmbedding` per type; the type is a Python string in the
    traced forward, so each layer's graph gathers from its own cache."""

    def __init__(self, per_type: dict[str, SpyreHFRotaryEmbedding]) -> None:
        super().__init__()
        self.per_type = nn.ModuleDict(per_type)

    def forward(
        self, x: torch.Tensor, position_ids: torch.Tensor, layer_type: str
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return self.per_type[layer_type](x, position_ids)


def _layer_types(module: nn.Module) -> list[str]:
    """The layer types of an HF rotary module with one frequency set per type (OLMo 3's
    ``{type}_inv_freq`` buffers, ``forward(x, position_ids, layer_type)``); else empty."""
    types_ = getattr(module, "layer_types", None) or ()
    return [t for t in types_ if isinstance(getattr(module, f"{t}_inv_freq", None), torch.Tensor)]


def _is_hf_rotary(module: nn.Module) -> bool:
    if not type(module).__name__.endswith("RotaryEmbedding"):
        return False
    return isinstance(getattr(module, "inv_freq", None), torch.Tensor) or bool(_layer_types(module))


def _rope_type(module: nn.Module, layer_type: str | None = None) -> str:
    rope_type = getattr(module, "rope_type", None)
    if isinstance(rope_type, dict) and layer_type is not None:
        rope_type = rope_type.get(layer_type)
    if isinstance(rope_type, str):
        return rope_type
    params = getattr(getattr(module, "config", None), "rope_parameters", None) or {}
    if layer_type is not None and isinstance(params.get(layer_type), dict):
        params = params[layer_type]
    return str(params.get("rope_type", "default")) if isinstance(params, dict) else "default"


def _frequencies(module: nn.Module, layer_type: str | None) -> tuple[torch.Tensor, float]:
    """The HF module's own (inv_freq, attention_scaling), of one layer type if given."""
    if layer_type is None:
        return module.inv_freq, float(getattr(module, "attention_scaling", 1.0))
    inv_freq = getattr(module, f"{layer_type}_inv_freq")
    return inv_freq, float(getattr(module, f"{layer_type}_attention_scaling", 1.0))


def _inv_freq_at(
    module: nn.Module, head_dim: int, layer_type: str | None = None
) -> tuple[torch.Tensor, float]:
    """The HF module's (inv_freq, attention_scaling) for a model of head size ``head_dim``.

    Uses the module's own RoPE initialisation (the default formula or
    transformers' ``ROPE_INIT_FUNCTIONS``) on a copy of its config whose
    ``head_dim`` is the original one, so scaled RoPE types stay exact.
    """
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    config = copy.copy(module.config)
    config.head_dim = head_dim
    rope_type = _rope_type(module, layer_type)
    kwargs = {} if layer_type is None else {"layer_type": layer_type}
    if rope_type == "default":
        inv_freq, scaling = type(module).compute_default_rope_parameters(config, **kwargs)
    else:
        inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](config, torch.device("cpu"), **kwargs)
    return inv_freq.float(), float(scaling)


def build_rotation_cache(
    module: nn.Module,
    max_positions: int,
    dtype: torch.dtype,
    pad: DimPad | None,
    head_dim: int | None = None,
    layer_type: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The rotation cache equivalent to the HF module over positions ``[0, max_positions)``,
    and the partner permutation when the module rotates part of a ``head_dim`` head.

    Same arithmetic as HF's forward: float32 ``position * inv_freq``, cos/sin
    times ``attention_scaling``, then rounded to ``dtype``. A module whose
    frequencies cover ``rotary_dim < head_dim`` entries (GPT-NeoX's
    ``rotary_pct``, Phi's ``partial_rotary_factor``; HF rotates the leading
    ``rotary_dim`` entries neox-style) gets the ops package's pair form.
    ``layer_type`` picks one frequency set of a per-layer-type module (OLMo 3).
    """
    rope_type = _rope_type(module, layer_type)
    if rope_type in DYNAMIC_ROPE_TYPES:
        raise NotImplementedError(
            f"{type(module).__name__} uses rope_type={rope_type!r}, whose frequencies change "
            "with the sequence length at run time; spyre-inference precomputes the rotation "
            "cache once and cannot serve it through the Transformers backend."
        )
    own_inv_freq, own_scaling = _frequencies(module, layer_type)
    rotary_dim = 2 * own_inv_freq.numel()
    partial = head_dim is not None and rotary_dim != head_dim
    if partial and pad is not None and rotary_dim > pad.original // 2:
        # The platform pins a partial share to the checkpoint's width, and HF's
        # modules derive it from the rescaled factor; Phi slices that share off
        # the padded head itself, so it must lie in the first [x1, 0] half.
        raise NotImplementedError(
            f"{type(module).__name__} rotates {rotary_dim} entries of a head widened "
            f"{pad.original} -> {pad.padded}: more than the first half of the original "
            "head (the models package's start-up check refuses this configuration)."
        )
    if pad is None or partial:
        # A partial module's frequencies are already at the checkpoint's width.
        inv_freq, scaling = own_inv_freq.float().cpu(), own_scaling
    else:
        inv_freq, scaling = _inv_freq_at(module, pad.original, layer_type)
    positions = torch.arange(max_positions, dtype=torch.int64).float()
    freqs = positions[:, None] * inv_freq[None, :]
    # HF's cos/sin repeat these over both halves; the cos | sin table keeps one.
    table = torch.cat(((freqs.cos() * scaling).to(dtype), (freqs.sin() * scaling).to(dtype)), -1)
    if partial:
        return pair_rotation_tables(table, head_dim, neox=True, pad=pad)
    if pad is not None:
        table = pad_table_halves(table, pad)
    return rotation_cache_from_cos_sin(table), None


_overlay_cache: dict[tuple[int, int], Callable[..., Any]] = {}


def _with_spyre_apply(fn: types.FunctionType) -> types.FunctionType:
    """``fn`` with ``apply_rotary_pos_emb`` resolved to the Spyre apply (cached per fn)."""
    key = (id(fn.__code__), id(fn.__globals__))
    cached = _overlay_cache.get(key)
    if cached is None:
        namespace = dict(fn.__globals__)
        namespace[APPLY_ROTARY_NAME] = spyre_apply_rotary_pos_emb
        cached = types.FunctionType(
            fn.__code__, namespace, fn.__name__, fn.__defaults__, fn.__closure__
        )
        cached.__kwdefaults__ = fn.__kwdefaults__
        cached.__qualname__ = fn.__qualname__
        _overlay_cache[key] = cached
    return cached


def _forward_function(module: nn.Module) -> types.FunctionType:
    forward = module.forward
    fn = forward.__func__ if isinstance(forward, types.MethodType) else forward
    return inspect.unwrap(fn)


class _SpyreRotaryBackendMixin:
    """What the Spyre Transformers backend classes add to upstream's: after the
    upstream ``__init__`` has built the HF model (with vLLM's fusers), its rotary
    modules and ``apply_rotary_pos_emb`` are replaced (see the module docstring)."""

    model: nn.Module

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "") -> None:
        super().__init__(vllm_config=vllm_config, prefix=prefix)  # type: ignore[call-arg]
        self._spyre_replace_rotary(vllm_config)

    def _spyre_replace_rotary(self, vllm_config: VllmConfig) -> None:
        model_config = vllm_config.model_config
        max_positions = model_config.max_model_len
        dtype = model_config.dtype
        plan = current_plan()
        pad = plan.head_dim if plan is not None else None
        if pad is not None and pad.padded == pad.original:
            pad = None

        replaced: list[str] = []
        for name, module in list(self.model.named_modules()):
            if not _is_hf_rotary(module):
                continue
            params = tuple(inspect.signature(module.forward).parameters)
            layer_types = _layer_types(module)
            if params not in REPLACEABLE_ROTARY_SIGNATURES or (
                (params == PER_LAYER_TYPE_SIGNATURE) != bool(layer_types)
            ):
                raise NotImplementedError(
                    f"{type(module).__name__} ({name}) has forward{params}; the Spyre "
                    "Transformers backend replaces rotary modules with the forward(x, "
                    "position_ids) signature, or forward(x, position_ids, layer_type) with "
                    "{layer_type}_inv_freq buffers, only."
                )
            head_size = model_config.get_head_size()
            source = type(module).__name__
            spyre: nn.Module
            if layer_types:
                per_type = {}
                for layer_type in layer_types:
                    cache, partner = build_rotation_cache(
                        module, max_positions, dtype, pad, head_size, layer_type
                    )
                    per_type[layer_type] = SpyreHFRotaryEmbedding(
                        cache, f"{source}[{layer_type}]", partner
                    )
                spyre = SpyreHFLayerTypeRotaryEmbedding(per_type)
            else:
                cache, partner = build_rotation_cache(module, max_positions, dtype, pad, head_size)
                spyre = SpyreHFRotaryEmbedding(cache, source, partner)
            parent_name, _, child = name.rpartition(".")
            parent = self.model.get_submodule(parent_name) if parent_name else self.model
            setattr(parent, child, spyre)
            replaced.append(name)
        attention = [
            (name, module)
            for name, module in self.model.named_modules()
            if isinstance(getattr(module, VLLM_ATTN_ATTR, None), AttentionLayerBase)
        ]
        if not replaced:
            # A model without RoPE (GPT-BigCode's learned absolute positions) has
            # nothing to replace; one whose attention still rotates does.
            rotating = [
                name
                for name, module in attention
                if APPLY_ROTARY_NAME in _forward_function(module).__code__.co_names
            ]
            if rotating:
                raise NotImplementedError(
                    f"{type(self.model).__name__} rotates in {rotating[0]} but has no Hugging "
                    "Face rotary module (a *RotaryEmbedding with inv_freq) for "
                    "spyre-inference to replace."
                )
            logger.info(
                "Transformers backend: %s has no rotary embedding; nothing to replace",
                type(self.model).__name__,
            )
            return

        rebound = 0
        for name, module in attention:
            fn = _forward_function(module)
            if APPLY_ROTARY_NAME not in fn.__code__.co_names:
                raise NotImplementedError(
                    f"{type(module).__name__} ({name}) does not rotate through "
                    f"{APPLY_ROTARY_NAME}(); the Spyre Transformers backend cannot apply "
                    "its rotation cache there."
                )
            module.forward = types.MethodType(_with_spyre_apply(fn), module)
            rebound += 1
        logger.info(
            "Transformers backend: Spyre rotation cache for %s (%d positions), %d attention "
            "modules rotate with the 2x2 matmul",
            ", ".join(replaced),
            max_positions,
            rebound,
        )


class SpyreTransformersForCausalLM(_SpyreRotaryBackendMixin, TransformersForCausalLM):
    """``TransformersForCausalLM`` whose RoPE is a precomputed Spyre rotation cache."""


class SpyreTransformersMoEForCausalLM(_SpyreRotaryBackendMixin, TransformersMoEForCausalLM):
    """``TransformersMoEForCausalLM`` (FlexOlmo, HunYuan MoE, ...) with the Spyre rotation
    cache; its experts are vLLM's ``FusedMoE``, which the Spyre MoE method computes."""


__all__ = [
    "SpyreHFLayerTypeRotaryEmbedding",
    "SpyreHFRotaryEmbedding",
    "SpyreTransformersForCausalLM",
    "SpyreTransformersMoEForCausalLM",
    "build_rotation_cache",
    "spyre_apply_rotary_pos_emb",
]
