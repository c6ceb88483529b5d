"""RoPE as a gather from a precomputed 2x2 rotation cache, fully in the graph.

Upstream derives ``cos``/``sin`` per step by chunking ``cos_sin_cache`` and
rotates with ``x * cos + rotate_neox(x) * sin`` (a negate, a concat and a
half-slice per head). The Spyre form precomputes, for every position, the 2x2
rotation matrix of each frequency::

    rotation_cache[pos, :, :, j] = [[cos, -sin],
                                    [sin,  cos]]      # [max_pos, 2, 2, rotary_dim//2]

so a step is one ``index_select`` of the positions' matrices and a 2x2
multiply of each head's two halves: no concat, no negation, no odd-offset
slice, and nothing that has to run off the device.

The cache is a buffer built at construction, on the host, from upstream's own
``cos_sin_cache`` (same frequencies, same dtype rounding); ``.to(device)``
moves it with the module, before the runner compiles anything. Building it
lazily inside a traced forward segfaults libsenlib during warm-up on Spyre,
whereas indexing an already-materialised device cache is clean.

Every vLLM RoPE variant whose forward is upstream's plain ``cos_sin_cache``
gather (default, llama3, YaRN, linear, NTK, dynamic NTK, Gemma 4's proportional) differs from the
default only in how it fills that table, so one mixin serves them all: the
upstream ``__init__`` runs, then the rotation cache is built from its table
(``_recompute_table`` is the per-variant hook). Longrope (Phi-3) fixes its
short-or-long choice per engine, so its table is one of two and it joins the
family the same way.

Neox-style rotary over the full head, what most checkpoints use, takes that
2x2 form. The rest (partial rotary, as StableLM, Phi-4-mini and Nemotron
rotate a leading share of each head; GPT-J-style interleaved pairs, as GPT-J,
Command-R and GLM-4) takes the *pair* form: per position a ``cos`` and a signed
``sin`` row over the whole head (1 and 0 where an entry does not rotate), and
each entry's partner gathered by one ``[head, head]`` permutation matmul::

    out = x * cos_row + (x @ partner) * sin_row

Every tensor spans whole heads, so nothing is sliced at the rotary width or
at odd offsets (Spyre moves 64-element sticks), and the partner gather is a
matmul the card runs natively rather than an index on the stick axis. The
matmul is exact: one product with 1.0 per output. The products and sums are
upstream's (``x1*cos - x2*sin``, ``x2*cos + x1*sin``) and the pass-through
entries come out as ``x*1 + x'*0``. Only checkpoints whose RoPE is not the
neox full-head kind pay for the matmul.

With head-dim stick padding (``spyre_inference.platform.stick_pad``) the cache
keeps the *original* frequencies and gives the padded entries of each half the
identity rotation; the padded Q/K entries are zero, so they stay zero. Partial
rotary on a padded head (StableLM-3B, Phi-2: head 80 -> 128) keeps the
checkpoint's rotary width, which the platform pins in the rope parameters, so
upstream's table is already right; the pair form places each pair where the
QKV loader's ``[x1, 0, x2, 0]`` layout put its entries.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from vllm.model_executor.layers.rotary_embedding import (
    DynamicNTKAlphaRotaryEmbedding,
    DynamicNTKScalingRotaryEmbedding,
    LinearScalingRotaryEmbedding,
    Llama3RotaryEmbedding,
    NTKScalingRotaryEmbedding,
    RotaryEmbedding,
    YaRNScalingRotaryEmbedding,
)
from vllm.model_executor.layers.rotary_embedding.gemma4_rope import Gemma4RotaryEmbedding
from vllm.model_executor.layers.rotary_embedding.phi3_long_rope_scaled_rope import (
    Phi3LongRoPEScaledRotaryEmbedding,
)

from spyre_inference.platform.layer_swaps import spyre_oot, spyre_replaces_built
from spyre_inference.platform.stick_pad import DimPad, current_plan


def rotation_cache_from_cos_sin(cos_sin_cache: torch.Tensor) -> torch.Tensor:
    """``[max_pos, rotary_dim]`` (cos | sin halves) -> ``[max_pos, 2, 2, rotary_dim//2]``."""
    cos, sin = cos_sin_cache.chunk(2, dim=-1)
    first_row = torch.stack((cos, -sin), dim=1)
    second_row = torch.stack((sin, cos), dim=1)
    return torch.stack((first_row, second_row), dim=1).contiguous()


def pad_table_halves(cos_sin: torch.Tensor, pad: DimPad) -> torch.Tensor:
    """``[P, original]`` cos | sin table -> ``[P, padded]`` with the identity rotation
    (cos 1, sin 0) on each half's padded entries.

    Stick padding widens the head with zeros at the end of each rotary half (the
    QKV loader's layout); the identity keeps those entries zero.
    """
    cos, sin = cos_sin.chunk(2, dim=-1)
    extra = (pad.padded - pad.original) // 2
    return torch.cat((F.pad(cos, (0, extra), value=1.0), F.pad(sin, (0, extra), value=0.0)), -1)


def rotate_neox_2x2(x: torch.Tensor, rotation: torch.Tensor, head_size: int) -> torch.Tensor:
    """Rotate every head of ``x`` (``[tokens, heads * head_size]`` or ``[tokens, heads,
    head_size]``) by the per-token matrices ``rotation`` (``[tokens, 2, 2, head_size//2]``).

    ``out[a] = R[a, 0] * x1 + R[a, 1] * x2`` for the halves ``x1``, ``x2`` of a head;
    the same products and sums as upstream's ``x1*cos - x2*sin``, ``x2*cos + x1*sin``.
    """
    shape = x.shape
    tokens = rotation.shape[0]
    halves = x.reshape(tokens, -1, 2, head_size // 2)
    rot = rotation.unsqueeze(1)  # [tokens, 1, 2, 2, half]
    out = rot[:, :, :, 0, :] * halves[:, :, 0:1, :] + rot[:, :, :, 1, :] * halves[:, :, 1:2, :]
    return out.reshape(shape)


def _padded_index(index: torch.Tensor, pad: DimPad | None) -> torch.Tensor:
    """Where an entry of the original head sits in the stick-padded one (``[x1, 0, x2, 0]``)."""
    if pad is None:
        return index
    half, half_padded = pad.original // 2, pad.padded // 2
    return torch.where(index < half, index, index - half + half_padded)


def pair_rotation_tables(
    cos_sin: torch.Tensor, head_size: int, neox: bool, pad: DimPad | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The pair form's tables: ``[P, 2, head]`` (cos row, signed sin row) and the
    ``[head, head]`` partner permutation, ``(x @ partner)[..., c] = x[..., partner_of(c)]``.

    ``cos_sin`` is upstream's ``[P, rotary_dim]`` table (cos | sin halves) over
    the first ``rotary_dim`` entries of the original head; neox pairs entry
    ``j`` with ``j + rotary_dim/2``, interleaved pairs ``2j`` with ``2j + 1``.
    ``head_size`` is the head the model is built with (``pad.padded`` under padding).
    """
    rows, rotary_dim = cos_sin.shape
    half = rotary_dim // 2
    cos, sin = cos_sin.chunk(2, dim=-1)
    j = torch.arange(half)
    first, second = (j, j + half) if neox else (2 * j, 2 * j + 1)
    first, second = _padded_index(first, pad), _padded_index(second, pad)
    cos_row = cos_sin.new_ones(rows, head_size)
    sin_row = cos_sin.new_zeros(rows, head_size)
    cos_row[:, first], cos_row[:, second] = cos, cos
    sin_row[:, first], sin_row[:, second] = -sin, sin
    partner_of = torch.arange(head_size)
    partner_of[first], partner_of[second] = second, first
    partner = cos_sin.new_zeros(head_size, head_size)
    partner[partner_of, torch.arange(head_size)] = 1.0
    return torch.stack((cos_row, sin_row), dim=1).contiguous(), partner


def rotate_pairs(
    x: torch.Tensor, tables: torch.Tensor, partner: torch.Tensor, head_size: int
) -> torch.Tensor:
    """Rotate every head of ``x`` (``[tokens, heads * head_size]`` or ``[tokens, heads,
    head_size]``) in the pair form: ``x * cos_row + (x @ partner) * sin_row`` with the
    per-token ``tables`` (``[tokens, 2, head_size]``)."""
    shape = x.shape
    heads = x.reshape(tables.shape[0], -1, head_size)
    swapped = torch.matmul(heads, partner)
    out = heads * tables[:, None, 0] + swapped * tables[:, None, 1]
    return out.reshape(shape)


def _max_model_len() -> int | None:
    """``max_model_len`` of the configuration being built, if any."""
    from vllm.config import get_current_vllm_config_or_none

    config = get_current_vllm_config_or_none()
    if config is None or config.model_config is None:
        return None
    return int(config.model_config.max_model_len)


class _SpyreRotaryMixin:
    """What every Spyre RoPE class adds to its upstream class.

    The upstream ``__init__`` runs unchanged (same signature, same
    ``cos_sin_cache``: every scaling's frequencies, YaRN's magnitude factor and
    the like are already in it), then the variant is checked and the rotation
    cache built from that table. A variant whose forward is not upstream's
    plain ``cos_sin_cache`` gather does not belong in this family.
    """

    head_size: int
    rotary_dim: int
    dtype: torch.dtype
    cos_sin_cache: torch.Tensor
    rotation_cache: torch.Tensor
    #: The pair form's ``[head, head]`` permutation; None in the 2x2 form.
    partner: torch.Tensor | None

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[call-arg]
        self._check_supported()
        self._build_rotation_cache()

    @property
    def is_neox_style(self) -> bool:
        return self._neox_style

    @is_neox_style.setter
    def is_neox_style(self, value: bool) -> None:
        # vLLM's Ernie 4.5 builds Llama's (neox) RoPE and then sets
        # ``rotary_emb.is_neox_style = False`` on each layer: the cache built at
        # construction must follow, in the form the new style takes.
        changed = getattr(self, "_neox_style", value) != value
        self._neox_style = bool(value)
        if changed and "rotation_cache" in self._buffers:  # type: ignore[attr-defined]
            device = self.rotation_cache.device
            self._build_rotation_cache()
            self.to(device)  # type: ignore[attr-defined]

    def _check_supported(self) -> None:
        name = type(self).__name__
        pad = self._head_pad()
        if self.rotary_dim != self.head_size and pad is not None:
            plan = current_plan()
            pinned = plan.rotary_dims if plan is not None else ()
            if self.rotary_dim not in pinned:
                # The platform pins the config's partial widths (stick_pad); a
                # width the model derived itself from the widened head (a
                # factor hard-coded in the model class) would rotate the wrong
                # entries.
                raise NotImplementedError(
                    f"{name}: partial rotary (rotary_dim={self.rotary_dim}) on a head padded "
                    f"{pad.original} -> {pad.padded}, but the config's rotary widths are "
                    f"{list(pinned) or 'full-head'}: the model derived the width from the "
                    "padded head."
                )
        if getattr(self, "cos_sin_cache", None) is None:
            raise NotImplementedError(
                f"{name} builds its rotation cache at construction; init_cache=False is "
                "not supported."
            )

    def _uses_2x2(self) -> bool:
        """Neox pairs over the whole head: the 2x2 form; anything else: the pair form."""
        return self.is_neox_style and self.rotary_dim == self.head_size

    def _head_pad(self) -> DimPad | None:
        plan = current_plan()
        pad = plan.head_dim if plan is not None else None
        if pad is None or self.head_size != pad.padded or pad.padded == pad.original:
            return None
        return pad

    def _recompute_table(self) -> torch.Tensor:
        """Upstream's ``cos | sin`` table at the current ``rotary_dim`` (the variant's hook)."""
        return self._compute_cos_sin_cache()  # type: ignore[attr-defined]

    def _build_rotation_cache(self) -> None:
        pad = self._head_pad()
        if pad is not None and self.rotary_dim == self.head_size:
            # The model was built with the padded head size, so upstream's
            # cache spreads frequencies over the padded width. Recompute them
            # over the original width (upstream's own formula, including its
            # scaling); the padded entries get the identity rotation below.
            padded_dim = self.rotary_dim
            self.rotary_dim = pad.original
            try:
                original = self._recompute_table().to(self.dtype)
            finally:
                self.rotary_dim = padded_dim
            self.cos_sin_cache = pad_table_halves(original, pad) if self._uses_2x2() else original
        # Scaled variants tabulate max_position_embeddings * factor positions
        # (131k for a YaRN x4 Qwen2.5, a million for Gemma 3 27B's linear x8);
        # positions never reach max_model_len, and the card holds what is kept.
        rows = _max_model_len()
        if rows is not None and rows < self.cos_sin_cache.shape[0]:
            self.cos_sin_cache = self.cos_sin_cache[:rows].contiguous()
        if self._uses_2x2():
            rotation = rotation_cache_from_cos_sin(self.cos_sin_cache)
            self.register_buffer("partner", None, persistent=False)  # type: ignore[attr-defined]
        else:
            rotation, partner = pair_rotation_tables(
                self.cos_sin_cache, self.head_size, self.is_neox_style, pad
            )
            self.register_buffer("partner", partner, persistent=False)  # type: ignore[attr-defined]
        self.register_buffer("rotation_cache", rotation, persistent=False)  # type: ignore[attr-defined]

    def dispatch_forward(self, compile_native: bool = False) -> Any:
        # Under Inductor vLLM defaults custom_ops to "none", which would send a
        # registered OOT op to forward_native (upstream's body). The Spyre body
        # is plain PyTorch and is what must run, on both targets.
        del compile_native
        return self.forward_oot

    def forward_oot(
        self,
        positions: torch.Tensor,
        query: torch.Tensor,
        key: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        rotation = self.rotation_cache
        if rotation.dtype != query.dtype:
            rotation = rotation.to(query.dtype)
        rotation = rotation.index_select(0, positions.reshape(-1))
        if self.partner is None:
            query = rotate_neox_2x2(query, rotation, self.head_size)
            if key is not None:
                key = rotate_neox_2x2(key, rotation, self.head_size)
            return query, key
        partner = self.partner.to(query.dtype)
        query = rotate_pairs(query, rotation, partner, self.head_size)
        if key is not None:
            key = rotate_pairs(key, rotation, partner, self.head_size)
        return query, key


# One Spyre class per upstream variant: vLLM's registry swaps by exact class
# name, so a subclass of RotaryEmbedding is not reached by the base's swap.
# Each differs from upstream only in the mixin; get_rope picks the variant from
# the checkpoint's rope_parameters.


@spyre_oot(RotaryEmbedding)
class SpyreRotaryEmbedding(_SpyreRotaryMixin, RotaryEmbedding):
    """``RotaryEmbedding`` (``rope_type: default``) as an index_select + 2x2 rotation."""


@spyre_oot(Llama3RotaryEmbedding)
class SpyreLlama3RotaryEmbedding(_SpyreRotaryMixin, Llama3RotaryEmbedding):
    """``rope_type: llama3`` (Llama 3.1+ wavelength-banded frequencies)."""


@spyre_oot(YaRNScalingRotaryEmbedding)
class SpyreYaRNScalingRotaryEmbedding(_SpyreRotaryMixin, YaRNScalingRotaryEmbedding):
    """``rope_type: yarn`` (Qwen2.5 / Qwen3 long context, gpt-oss): ramped
    frequencies and the magnitude factor ``mscale``, both in upstream's table."""


@spyre_oot(LinearScalingRotaryEmbedding)
class SpyreLinearScalingRotaryEmbedding(_SpyreRotaryMixin, LinearScalingRotaryEmbedding):
    """``rope_type: linear`` (Gemma 3's global layers): positions divided by the factor."""

    scaling_factors: list[float]

    def _check_supported(self) -> None:
        super()._check_supported()
        if len(self.scaling_factors) != 1:
            # Several factors concatenate several tables that a caller indexes
            # with per-request offsets; vLLM's get_rope never builds that.
            raise NotImplementedError(
                f"{type(self).__name__} with several scaling factors "
                f"({self.scaling_factors}) is not supported."
            )


@spyre_oot(NTKScalingRotaryEmbedding)
class SpyreNTKScalingRotaryEmbedding(_SpyreRotaryMixin, NTKScalingRotaryEmbedding):
    """``rope_type: ntk`` (base stretched by the factor, optional mixed base)."""


@spyre_oot(DynamicNTKScalingRotaryEmbedding)
class SpyreDynamicNTKScalingRotaryEmbedding(_SpyreRotaryMixin, DynamicNTKScalingRotaryEmbedding):
    """``rope_type: dynamic`` with ``factor``. vLLM tabulates it once for the
    longest scaled length (it does not re-derive the base per sequence as
    transformers does), and so does the rotation cache."""


@spyre_oot(DynamicNTKAlphaRotaryEmbedding)
class SpyreDynamicNTKAlphaRotaryEmbedding(_SpyreRotaryMixin, DynamicNTKAlphaRotaryEmbedding):
    """``rope_type: dynamic`` with ``alpha`` (Hunyuan): a statically stretched base."""


@spyre_oot(Gemma4RotaryEmbedding)
class SpyreGemma4RotaryEmbedding(_SpyreRotaryMixin, Gemma4RotaryEmbedding):
    """``rope_type: proportional`` (Gemma 4's global layers): exponents over the whole
    head and identity rotation (zero frequency) on the pairs past
    ``partial_rotary_factor``; upstream rotates the full head, so the rotation
    cache covers it like the default's."""

    rope_angles: int
    nope_angles: int

    def _recompute_table(self) -> torch.Tensor:
        # The exponents divide by head_size, not rotary_dim: under stick
        # padding both are the original width while the table is recomputed.
        saved = self.head_size, self.nope_angles
        self.head_size = self.rotary_dim
        self.nope_angles = self.rotary_dim // 2 - self.rope_angles
        try:
            return super()._recompute_table()
        finally:
            self.head_size, self.nope_angles = saved


@spyre_replaces_built(Phi3LongRoPEScaledRotaryEmbedding)
class SpyrePhi3LongRoPEScaledRotaryEmbedding(_SpyreRotaryMixin, Phi3LongRoPEScaledRotaryEmbedding):
    """``rope_type: longrope`` (Phi-3, Phi-3.5): per-frequency short and long factors.

    vLLM 0.33 chooses the factors once per engine (``use_long_rope``: the long
    ones when ``max_model_len`` exceeds ``original_max_position_embeddings``)
    and indexes the long half of its joint short|long table at ``position +
    original_max_position_embeddings``, an integer add on every step. The
    rotation cache holds the chosen table alone, indexed by position, so the
    forward is the family's plain gather.

    Upstream is a plain ``nn.Module`` (not a ``CustomOp``), which vLLM's
    out-of-tree registry never sees: the runner swaps the built instances
    (:func:`~spyre_inference.platform.layer_swaps.swap_built_modules`), before
    the model moves to the device.
    """

    #: Upstream refuses anything else at construction.
    is_neox_style = True
    long_short_cos_sin_cache: torch.Tensor
    use_long_rope: bool
    original_max_position_embeddings: int
    max_position_embeddings: int
    short_factor: list[float]
    long_factor: list[float]
    short_mscale: float
    long_mscale: float

    _UPSTREAM_FIELDS = (
        "head_size",
        "rotary_dim",
        "max_position_embeddings",
        "original_max_position_embeddings",
        "base",
        "short_factor",
        "long_factor",
        "short_mscale",
        "long_mscale",
        "use_long_rope",
    )

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # The joint table is upstream's forward's alone; the rotation cache replaces it.
        del self.long_short_cos_sin_cache

    @classmethod
    def from_upstream(
        cls, upstream: Phi3LongRoPEScaledRotaryEmbedding
    ) -> SpyrePhi3LongRoPEScaledRotaryEmbedding:
        """The Spyre module for an already-built upstream one (same factors and choice)."""
        new = cls.__new__(cls)
        torch.nn.Module.__init__(new)
        for name in cls._UPSTREAM_FIELDS:
            setattr(new, name, getattr(upstream, name))
        new.dtype = upstream.long_short_cos_sin_cache.dtype
        new.cos_sin_cache = new._recompute_table()
        new._check_supported()
        new._build_rotation_cache()
        return new

    def _check_supported(self) -> None:
        if getattr(self, "cos_sin_cache", None) is None:
            self.dtype = self.long_short_cos_sin_cache.dtype
            self.cos_sin_cache = self._recompute_table()
        super()._check_supported()

    def _recompute_table(self) -> torch.Tensor:
        # One factor per frequency of the current width: under head-dim stick
        # padding the config's lists were extended for the padded width (the
        # platform's stick_pad), and the original width uses the leading ones.
        pairs = self.rotary_dim // 2
        if self.use_long_rope:
            rows, factors, mscale = (
                self.max_position_embeddings,
                self.long_factor,
                self.long_mscale,
            )
        else:
            rows, factors, mscale = (
                self.original_max_position_embeddings,
                self.short_factor,
                self.short_mscale,
            )
        return self._compute_cos_sin_cache(rows, factors[:pairs], mscale).to(self.dtype)

    def forward(
        self,
        positions: torch.Tensor,
        query: torch.Tensor,
        key: torch.Tensor | None = None,
        offsets: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        if offsets is not None:
            raise NotImplementedError("longrope with per-request position offsets")
        return self.forward_oot(positions, query, key)


__all__ = [
    "SpyreDynamicNTKAlphaRotaryEmbedding",
    "SpyreDynamicNTKScalingRotaryEmbedding",
    "SpyreLinearScalingRotaryEmbedding",
    "SpyreLlama3RotaryEmbedding",
    "SpyreNTKScalingRotaryEmbedding",
    "SpyrePhi3LongRoPEScaledRotaryEmbedding",
    "SpyreRotaryEmbedding",
    "SpyreYaRNScalingRotaryEmbedding",
    "pad_table_halves",
    "pair_rotation_tables",
    "rotate_neox_2x2",
    "rotate_pairs",
    "rotation_cache_from_cos_sin",
]
