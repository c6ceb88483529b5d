"""Stick padding of a model's head and MLP widths: one plan, decided from the config.

Spyre moves data in 64-element sticks, so a head dimension or an MLP
intermediate width that is not a whole number of sticks cannot be sliced or
reshaped where the model needs it. The plugin widens those dimensions *before
the model is built*: the platform calls :func:`widen_config` from
``check_and_update_config``, which rewrites ``head_dim`` / ``intermediate_size``
in the model's Hugging Face text config to the padded sizes and records the
original sizes in ``vllm_config.additional_config``. vLLM then constructs every
layer (fused QKV, O projection, RoPE, attention, gate/up and down projections,
KV cache) at the padded width, and the ops package's layer swaps zero-pad the
checkpoint tensors as they are loaded.

The plan lives here, in the core, because three packages read it and none of
them may import another: the platform writes it, the ops package's weight
loaders and RoPE read it, and the attention backend reads it to keep the
attention scale of the *original* head size (:func:`attention_scale`).

Padding is exact, not approximate:

* MLP: the extra gate/up rows are zero, so the extra activations are
  ``act(0) * 0``; the extra down-projection columns are zero as well, so the
  output does not depend on them at all.
* Heads: each head is padded per rotary half (``[x1, 0, x2, 0]``), so the
  neox 2x2 rotation pairs element ``i`` with ``i + padded/2`` exactly as the
  unpadded head pairs ``i`` with ``i + original/2``; padded Q/K entries are zero,
  so ``q . k`` is unchanged, padded V entries are zero, so the padded output
  columns are zero and meet zero O-projection columns.
* Partial RoPE (a leading share of each head rotates): the rotary width stays
  the checkpoint's (:func:`widen_config` pins it in the rope parameters), and
  the ops package's pair form places its pairs in the padded layout.
"""

from __future__ import annotations

import dataclasses
import math
from typing import TYPE_CHECKING, Any

from vllm.logger import init_logger

from spyre_inference.platform.device import STICK_ELEMS, round_up

if TYPE_CHECKING:
    from vllm.config import VllmConfig

logger = init_logger(__name__)

#: Key of the plan in ``vllm_config.additional_config`` (a dict that vLLM
#: pickles to every worker and folds into its compile-cache hash).
PLAN_KEY = "spyre_stick_pad"


@dataclasses.dataclass(frozen=True)
class DimPad:
    """One widened dimension: what the checkpoint has, what the model is built with."""

    original: int
    padded: int

    def __post_init__(self) -> None:
        if self.padded < self.original:
            raise ValueError(f"padded size {self.padded} < original {self.original}")


@dataclasses.dataclass(frozen=True)
class StickPadPlan:
    """The widened dimensions of one model (``None``: that dimension is not padded).

    ``rotary_dims`` are the rotary widths of partial RoPE on a widened head:
    they stay at the checkpoint's width (:func:`widen_config` pins them in the
    rope parameters), and the ops package's RoPE accepts exactly these.
    """

    head_dim: DimPad | None = None
    intermediate_size: DimPad | None = None
    rotary_dims: tuple[int, ...] = ()

    def to_dict(self) -> dict[str, list[int]]:
        out: dict[str, list[int]] = {}
        for name in ("head_dim", "intermediate_size"):
            pad = getattr(self, name)
            if pad is not None:
                out[name] = [pad.original, pad.padded]
        if self.rotary_dims:
            out["rotary_dims"] = list(self.rotary_dims)
        return out

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> StickPadPlan:
        kwargs: dict[str, Any] = {}
        for name in ("head_dim", "intermediate_size"):
            if name in raw:
                original, padded = raw[name]
                kwargs[name] = DimPad(int(original), int(padded))
        kwargs["rotary_dims"] = tuple(int(d) for d in raw.get("rotary_dims", ()))
        return cls(**kwargs)

    def is_empty(self) -> bool:
        return self.head_dim is None and self.intermediate_size is None


def plan_for(head_dim: int | None, intermediate_size: int | None, tp_size: int = 1) -> StickPadPlan:
    """The padding a model with these widths needs.

    The head dimension is padded to a whole stick (heads are never split across
    ranks). The intermediate width is split across TP ranks, so it is padded to
    a multiple of ``64 * tp_size``: every rank's slice is then whole sticks.
    """
    head = None
    if head_dim and head_dim % STICK_ELEMS:
        if head_dim % 2:
            raise ValueError(
                f"head_dim={head_dim} is odd; the neox rotary layout the plugin pads "
                "around needs two equal halves."
            )
        head = DimPad(head_dim, round_up(head_dim))
    mlp = None
    if intermediate_size:
        padded = round_up(intermediate_size, STICK_ELEMS * tp_size)
        if padded != intermediate_size:
            mlp = DimPad(intermediate_size, padded)
    return StickPadPlan(head_dim=head, intermediate_size=mlp)


def plan_from_config(vllm_config: VllmConfig | None) -> StickPadPlan | None:
    """The plan recorded by :func:`widen_config`, or ``None`` (nothing padded)."""
    if vllm_config is None:
        return None
    extra = vllm_config.additional_config
    if not isinstance(extra, dict) or PLAN_KEY not in extra:
        return None
    plan = StickPadPlan.from_dict(extra[PLAN_KEY])
    return None if plan.is_empty() else plan


def current_plan() -> StickPadPlan | None:
    """The plan of the vLLM config being built or loaded right now.

    Layers call this from ``__init__``, which vLLM runs inside
    ``set_current_vllm_config``; they keep the answer for load time.
    """
    from vllm.config import get_current_vllm_config_or_none

    return plan_from_config(get_current_vllm_config_or_none())


def _widened(model_config: Any) -> bool:
    """Whether :func:`widen_config` pads this model's widths at all (see there)."""
    return model_config is not None and getattr(model_config, "runner_type", None) in (
        "generate",
        "draft",
    )


def head_dim_to_pad(vllm_config: VllmConfig) -> int | None:
    """The head dimension :func:`widen_config` would pad, or ``None`` when it is whole sticks.

    Read before widening, so start-up checks can refuse a head that cannot be
    padded (odd) or that nothing will pad (the ops package is not loaded).
    Quantized checkpoints keep their widths (the padding loaders rewrite plain
    weight tensors only) and MLA has no per-head dimension to pad.
    """
    model_config = vllm_config.model_config
    if (
        plan_from_config(vllm_config) is not None
        or not _widened(model_config)
        or model_config.quantization is not None
        or model_config.use_mla
    ):
        return None
    head_dim = model_config.get_head_size()
    return head_dim if head_dim % STICK_ELEMS else None


#: Rope parameters that hold one entry per rotary frequency (longrope, Phi-3).
PER_FREQUENCY_ROPE_FIELDS = ("short_factor", "long_factor")
#: Rope types whose partial factor still rotates the whole head (the pairs past
#: the factor get the identity rotation): Gemma 4's ``proportional``.
FULL_HEAD_PARTIAL_ROPE_TYPES = frozenset({"proportional"})


def rope_parameter_sets(text_config: Any) -> list[dict[str, Any]]:
    """The model's rope parameter dicts (one per layer type when nested, as in Gemma 3).

    The dicts are the config's own: writing to them changes the config.
    """
    params = getattr(text_config, "rope_parameters", None)
    if not isinstance(params, dict) or not params:
        return []
    if all(isinstance(v, dict) for v in params.values()):
        return [v for v in params.values() if v]
    return [params]


def partial_rotary_width(params: dict[str, Any], text_config: Any, head_size: int) -> int | None:
    """How many entries of a ``head_size`` head one rope parameter set rotates, when
    that is not the whole head; ``None`` for a full-head rotation.

    Read the way vLLM 0.33's ``get_rope`` reads it: ``rope_dim``, else
    ``head_size * partial_rotary_factor`` (vLLM's ``patch_rope_parameters``
    moves the legacy ``rotary_pct`` / ``rotary_emb_fraction`` names into the
    rope parameters); Gemma 4's ``proportional`` type rotates the whole head.
    """
    if params.get("rope_type") in FULL_HEAD_PARTIAL_ROPE_TYPES:
        return None
    rope_dim = params.get("rope_dim")
    if rope_dim is not None:
        width = int(rope_dim)
    else:
        factor = params.get(
            "partial_rotary_factor", getattr(text_config, "partial_rotary_factor", None)
        )
        width = int(head_size * float(factor)) if factor is not None else head_size
    return None if width == head_size else width


def _factor_for(width: int, head_size: int) -> float:
    """A partial factor ``f`` with ``int(head_size * f) == round(head_size * f) == width``."""
    factor = width / head_size
    while int(head_size * factor) < width:
        factor = math.nextafter(factor, 1.0)
    return factor


def _pin_partial_rotary(text_config: Any, pad: DimPad) -> tuple[int, ...]:
    """Keep partial RoPE at the checkpoint's rotary width once the head is widened.

    Every reader derives the rotary width from the head size it is built with,
    which is now the padded one (StableLM-3B and Phi-2: 80 -> 128, a share of
    0.25 / 0.4). Each parameter set gets ``rope_dim`` (what vLLM's ``get_rope``
    reads first) and a factor rescaled to the padded head (what Hugging Face's
    modules, run by vLLM's Transformers backend, and models that multiply
    themselves read), both giving the original width. The QKV loader's
    ``[x1, 0, x2, 0]`` layout keeps every original entry at a fixed place, and
    the ops package's pair-form RoPE maps its pairs there.
    """
    widths: set[int] = set()
    for params in rope_parameter_sets(text_config):
        width = partial_rotary_width(params, text_config, pad.original)
        if width is None:
            continue
        params["rope_dim"] = width
        params["partial_rotary_factor"] = _factor_for(width, pad.padded)
        widths.add(width)
    if widths and getattr(text_config, "partial_rotary_factor", None) is not None:
        if len(widths) == 1:
            text_config.partial_rotary_factor = _factor_for(next(iter(widths)), pad.padded)
    return tuple(sorted(widths))


def _widen_rope_factors(text_config: Any, pad: DimPad) -> None:
    """Give per-frequency RoPE factor lists one entry per frequency of the padded head.

    vLLM builds RoPE at the widened head size, and longrope's upstream
    constructor multiplies its factor list with one inverse frequency per pair
    of the *padded* head. The appended factors (1.0) only shape that table: the
    ops package's RoPE recomputes its rotations at the original width and gives
    the padded pairs the identity rotation.
    """
    extra = [1.0] * ((pad.padded - pad.original) // 2)
    for params in rope_parameter_sets(text_config):
        for field in PER_FREQUENCY_ROPE_FIELDS:
            factors = params.get(field)
            if isinstance(factors, list) and len(factors) == pad.original // 2:
                params[field] = [*factors, *extra]


def widen_config(vllm_config: VllmConfig) -> StickPadPlan | None:
    """Widen the model config to whole sticks and record the plan (idempotent).

    Must run before the model is constructed (the platform's
    ``check_and_update_config``), because vLLM sizes every layer from the
    config. Only generative text models are widened: encoder-only models
    (BERT, RoBERTa) size heads from ``hidden_size // num_heads`` regardless of
    the config, and the encoder attention backend pads their head dimension
    itself. MLA and MoE widths are left alone (their own paths own them).
    """
    existing = plan_from_config(vllm_config)
    if existing is not None:
        return existing
    model_config = vllm_config.model_config
    if not _widened(model_config):
        return None
    if not isinstance(vllm_config.additional_config, dict):
        raise ValueError(
            "spyre-inference records its stick-padding plan in additional_config, which "
            f"must be a dict here (got {type(vllm_config.additional_config).__name__})."
        )
    if model_config.quantization is not None:
        # The padding loaders rewrite plain weight tensors only; packed
        # quantized checkpoints are left at their own widths.
        logger.warning(
            "Quantized model (%s): head_dim / intermediate_size are not stick-padded.",
            model_config.quantization,
        )
        return None
    text_config = model_config.hf_text_config
    head_dim = None if model_config.use_mla else model_config.get_head_size()
    intermediate = getattr(text_config, "intermediate_size", None)
    if not isinstance(intermediate, int) or model_config.get_num_experts() > 0:
        intermediate = None
    tp_size = vllm_config.parallel_config.tensor_parallel_size
    plan = plan_for(head_dim, intermediate, tp_size)
    if plan.is_empty():
        return None

    if plan.head_dim is not None:
        text_config.head_dim = plan.head_dim.padded
        rotary_dims = _pin_partial_rotary(text_config, plan.head_dim)
        _widen_rope_factors(text_config, plan.head_dim)
        plan = dataclasses.replace(plan, rotary_dims=rotary_dims)
        logger.info(
            "Padding head_dim %d -> %d (64-element Spyre stick); attention keeps the "
            "scale of the original head size.",
            plan.head_dim.original,
            plan.head_dim.padded,
        )
    if plan.intermediate_size is not None:
        text_config.intermediate_size = plan.intermediate_size.padded
        logger.info(
            "Padding intermediate_size %d -> %d (whole sticks per TP rank); the extra "
            "columns are zero.",
            plan.intermediate_size.original,
            plan.intermediate_size.padded,
        )
    # vLLM caches the architecture summary (head size, ...) at ModelConfig
    # init; rebuild it so get_head_size() agrees with the widened config.
    model_config.model_arch_config = model_config.get_model_arch_config()
    vllm_config.additional_config[PLAN_KEY] = plan.to_dict()
    return plan


def attention_scale(head_size: int, scale: float, plan: StickPadPlan | None = None) -> float:
    """The softmax scale an attention layer must use, given what the model passed.

    Models derive their scale from ``head_dim`` (``head_dim ** -0.5``), which the
    widened config made the padded size; the zero padding leaves ``q . k``
    unchanged, so the right scale is still the original ``head_dim ** -0.5``.
    A scale that is *not* ``padded ** -0.5`` came from elsewhere (Granite's
    ``attention_multiplier``, Gemma's ``query_pre_attn_scalar``) and is kept.
    """
    if plan is None:
        plan = current_plan()
    pad = plan.head_dim if plan is not None else None
    if pad is None or head_size != pad.padded or pad.padded == pad.original:
        return scale
    if math.isclose(scale, pad.padded**-0.5, rel_tol=1e-6):
        return pad.original**-0.5
    return scale


__all__ = [
    "FULL_HEAD_PARTIAL_ROPE_TYPES",
    "PLAN_KEY",
    "DimPad",
    "StickPadPlan",
    "attention_scale",
    "current_plan",
    "head_dim_to_pad",
    "partial_rotary_width",
    "plan_for",
    "plan_from_config",
    "rope_parameter_sets",
    "widen_config",
]
