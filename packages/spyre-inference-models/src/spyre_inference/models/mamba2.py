"""Mamba2 mixers (Granite 4 hybrid stacks) without vLLM's compiled kernels.

vLLM's ``MambaMixer2`` runs its causal conv1d and its state-space scan through
Triton kernels, or, when ``current_platform.is_cpu()``, through ``vllm._C``
CPU kernels; this platform has neither (vLLM is built with
``VLLM_TARGET_DEVICE=empty``). :class:`SpyreMambaMixer2` replaces the layer
(``PluggableLayer.register_oot``, vLLM's documented swap for whole layers) and
keeps everything of it but the conv + scan step, which it computes in PyTorch:

* **prefill** (per sequence, the spec's host-driven loop as for attention): the
  causal conv1d over the sequence and its carried conv state, then the SSD
  *chunked* scan: within a chunk of :data:`CHUNK` tokens (one 64-element
  stick) the output is a masked ``[chunk, chunk]`` matrix product, and only
  the per-chunk states are carried from chunk to chunk; no token-by-token
  loop. The sequence is zero-padded to whole chunks, with ``dt = 0`` on the
  padding, which makes a padding token neither write nor decay the state.
* **decode** (all decodes at once): one recurrent step of the conv window
  and of the state, gathered and scattered at the requests' state slots.

The states live where vLLM's hybrid KV-cache manager puts them (``MambaSpec``
pages, through the runner's KV-cache allocation): ``kv_cache[0]`` the conv
state, ``kv_cache[1]`` the SSM state ``[slots, heads, head_dim, d_state]``,
each width rounded up to whole 64-element sticks (:func:`stick_padded_state_shapes`;
the pads hold zeros and add nothing).
Slot indices are host integers and the whole step runs inside vLLM's opaque
``mamba_mixer2`` op, like attention inside its own: the block graph around it
(in/out projections, gated norm) compiles as usual.

The arithmetic is the Mamba2 recurrence (per head ``h``, with
``dt = softplus(dt_raw + dt_bias)`` and ``A = -exp(A_log)``)::

    state = exp(dt * A) * state + dt * x (outer) B
    y     = state . C + D * x

in float32 on the cpu target and in the model's float16 on the card (which
computes in float16 only), the states stored back in their cache dtype.

On the card path (spec, "Device Placement Strategy") the step keeps to what the
device has: no bool or integer compute (the causal mask and the within-chunk
cumulative sum are products with one host-built lower-triangular float matrix,
placed on the device once), the conv as ``width`` shifted multiply-adds rather
than ``conv1d``, and integer slot indices built on the host and placed only as
gather/scatter indices, once per step for all layers. Shapes are static per
chunk count (the scan pads to whole 64-token chunks). The ops run eagerly on
the device inside the opaque mixer op, as the MoE dispatch does.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from vllm.forward_context import get_forward_context
from vllm.model_executor.layers.mamba.mamba_mixer2 import MambaMixer2
from vllm.model_executor.layers.mamba.mamba_utils import is_conv_state_dim_first

from spyre_inference.platform import device as dev
from spyre_inference.platform.layer_swaps import spyre_oot
from spyre_inference.platform.logs import get_logger

logger = get_logger(__name__)

#: Tokens per chunk of the prefill scan: one 64-element stick, so the chunk's
#: ``[chunk, chunk]`` decay and score matrices are stick-aligned on the card.
CHUNK = 64


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """The mixer's arithmetic dtype: float32 on the cpu target, ``dtype`` on the card.

    The card computes in float16 only (spec, "Supported dtypes"); the host has
    float32 for free, and the scan's decays compound over long prompts.
    """
    return dtype if dev.is_spyre() else torch.float32


def stick_padded_state_shapes(
    shapes: tuple[tuple[int, ...], ...],
) -> tuple[tuple[int, int], tuple[int, int, int]]:
    """vLLM's Mamba2 ``(conv, ssm)`` state shapes with their widths in whole sticks.

    The conv state's channel width (``intermediate + 2 * groups * d_state`` per
    rank) and the SSM state's ``head_dim`` and ``d_state`` are rounded up to
    64-element sticks (spec, "stick alignment"); the padded entries stay zero.
    Granite 4's checkpoints (head 64, state 128) are already whole sticks, so
    their shapes do not change.
    """
    if len(shapes) != 2:
        raise NotImplementedError(f"Mamba2 states of {len(shapes)} tensors (expected conv, ssm)")
    conv, (heads, head_dim, state) = shapes
    if is_conv_state_dim_first():
        conv = (dev.round_up(conv[0]), conv[1])
    else:
        conv = (conv[0], dev.round_up(conv[1]))
    return conv, (heads, dev.round_up(head_dim), dev.round_up(state))


def _pad_last(t: torch.Tensor, size: int) -> torch.Tensor:
    """Zero-pad the last dimension of ``t`` to ``size`` entries (no-op when equal)."""
    extra = size - t.shape[-1]
    return F.pad(t, (0, extra)) if extra else t


@functools.cache
def _lower_ones(device: torch.device, dtype: torch.dtype, size: int) -> torch.Tensor:
    """``L[t, s] = 1`` for ``s <= t``: the causal mask and the prefix-sum matrix.

    Built on the host and placed once per device and dtype: the card has no
    bool tensors to mask with and no scan to take a cumulative sum with, so
    both are products with this float matrix.
    """
    lower = torch.ones(size, size).tril()
    return lower.to(dtype) if device.type == "cpu" else dev.to_device(lower, dtype)


def _dt(dt_raw: torch.Tensor, dt_bias: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``softplus(dt + dt_bias)`` (vLLM's ``dt_softplus=True``, no limit)."""
    return F.softplus(dt_raw.to(dtype) + dt_bias.to(dtype))


def _per_head(t: torch.Tensor, heads: int) -> torch.Tensor:
    """``[..., G, N]`` -> ``[..., H, N]``: head ``h`` reads group ``h // (H // G)``."""
    *lead, groups, n = t.shape
    return t.unsqueeze(-2).expand(*lead, groups, heads // groups, n).reshape(*lead, heads, n)


def causal_conv1d(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    state: torch.Tensor | None,
    dtype: torch.dtype = torch.float32,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Depthwise causal conv + SiLU of one sequence.

    Computed as ``width`` shifted multiply-adds of the window, not ``conv1d``:
    the card has no convolution kernel, and the width is 4.

    Args:
        x: ``[T, dim]`` the sequence's conv input.
        weight: ``[dim, width]``.
        state: ``[dim, width - 1]`` the inputs before ``x`` (None: zeros, a new
            sequence).
        dtype: the arithmetic dtype (:func:`compute_dtype`).

    Returns:
        ``([T, dim]`` output in ``dtype``, ``[dim, width - 1]`` the state after ``x``).
    """
    dim, width = weight.shape
    T = x.shape[0]
    if state is None:
        state = x.new_zeros(dim, width - 1)
    window = torch.cat((state.to(x.dtype), x.t()), dim=1)  # [dim, width - 1 + T]
    w = weight.to(dtype)
    wide = window.to(dtype)
    out = wide[:, :T] * w[:, :1]
    for k in range(1, width):
        out = out + wide[:, k : k + T] * w[:, k : k + 1]
    if bias is not None:
        out = out + bias.to(dtype).unsqueeze(-1)
    return F.silu(out).t(), window[:, window.shape[1] - (width - 1) :]


def ssd_scan(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor,
    state: torch.Tensor | None,
    chunk: int = CHUNK,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The Mamba2 scan of one sequence, chunk by chunk (SSD form).

    Args:
        x: ``[T, H, P]``; dt: ``[T, H]`` after softplus, in the arithmetic
            dtype (:func:`compute_dtype`), which the scan computes in; A, D: ``[H]``.
        B, C: ``[T, G, N]`` (heads ``g * H // G ..`` read group ``g``).
        state: ``[H, P, N]`` before the sequence, or None (zeros).

    Returns:
        ``([T, H, P]`` output, ``[H, P, N]`` final state), in ``dt``'s dtype.
    """
    T, H, P = x.shape
    N = B.shape[2]
    cdt = dt.dtype
    nc = -(-T // chunk)
    pad = nc * chunk - T
    xf, dtf = x.to(cdt), dt
    Bf = _per_head(B.to(cdt), H)  # [T, H, N]
    Cf = _per_head(C.to(cdt), H)
    if pad:
        # dt = 0 on padding: no input written, decay exp(0) = 1 (state kept).
        xf, dtf, Bf, Cf = (F.pad(t, (0,) * (2 * t.dim() - 1) + (pad,)) for t in (xf, dtf, Bf, Cf))
    xc = xf.view(nc, chunk, H, P)
    Bc = Bf.view(nc, chunk, H, N)
    Cc = Cf.view(nc, chunk, H, N)
    a = (dtf * A.to(cdt)).view(nc, chunk, H).transpose(1, 2)  # [nc, H, chunk] log-decay
    lower = _lower_ones(x.device, cdt, chunk)
    acum = a @ lower.t()  # inclusive prefix sum over the chunk
    # decay[c, h, t, s] = exp(acum[t] - acum[s]) for s <= t, else 0. The log
    # decays are <= 0, so acum falls along the chunk: clamping at 0 only
    # touches s > t, which the mask zeroes (no inf is ever formed).
    seg = acum.unsqueeze(-1) - acum.unsqueeze(-2)
    decay = torch.exp(seg.clamp(max=0)) * lower
    xdt = xc * dtf.view(nc, chunk, H, 1)  # dt_s * x_s
    # Within a chunk: y_t = sum_s decay[t, s] (C_t . B_s) dt_s x_s.
    scores = torch.einsum("cthn,cshn->chts", Cc, Bc) * decay
    y = torch.einsum("chts,cshp->cthp", scores, xdt)
    # Each chunk's own contribution to the state at its end.
    to_end = torch.exp(acum[..., -1:] - acum)  # [nc, H, chunk]
    chunk_states = torch.einsum("chs,cshp,cshn->chpn", to_end, xdt, Bc)
    # Carry the state over chunks: the only sequential part, nc steps.
    carried = x.new_zeros(H, P, N, dtype=cdt) if state is None else state.to(cdt)
    chunk_decay = torch.exp(acum[..., -1])  # [nc, H]
    starts = []
    for c in range(nc):
        starts.append(carried)
        carried = carried * chunk_decay[c].view(H, 1, 1) + chunk_states[c]
    start = torch.stack(starts)  # [nc, H, P, N] state entering each chunk
    # From the carried state: y_t += exp(acum[t]) C_t . state_in.
    y = y + torch.einsum("cthn,chpn->cthp", Cc, start) * torch.exp(acum).transpose(1, 2).unsqueeze(
        -1
    )
    y = y.reshape(nc * chunk, H, P)[:T] + xf[:T] * D.to(cdt).view(1, H, 1)
    return y, carried


def ssd_step(
    state: torch.Tensor,
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One recurrent step of ``S`` sequences: ``state [S, H, P, N]``, ``x [S, H, P]``,
    ``dt [S, H]``, ``B``/``C`` ``[S, G, N]``; returns ``(y [S, H, P], new state)`` in
    ``dt``'s dtype (the arithmetic dtype, :func:`compute_dtype`)."""
    H = x.shape[1]
    cdt = dt.dtype
    Bh = _per_head(B.to(cdt), H)  # [S, H, N]
    Ch = _per_head(C.to(cdt), H)
    xf = x.to(cdt)
    decay = torch.exp(dt * A.to(cdt)).view(*dt.shape, 1, 1)
    new = state.to(cdt) * decay + (xf * dt.unsqueeze(-1)).unsqueeze(-1) * Bh.unsqueeze(2)
    y = torch.einsum("shpn,shn->shp", new, Ch) + xf * D.to(cdt).view(1, H, 1)
    return y, new


def _host_ints(t: torch.Tensor | None) -> list[int]:
    return [] if t is None else [int(v) for v in t.reshape(-1).tolist()]


#: Attribute under which a step's Mamba metadata keeps its device-side indices.
_STEP_INDICES = "_spyre_step_indices"


def _step_index(md: Any, key: str, build: Callable[[], torch.Tensor]) -> torch.Tensor:
    """A device index of this step, built once for all the group's layers.

    vLLM builds one metadata object per KV-cache group and step and hands it
    to every layer of the group, so the host list -> device index conversion
    (the card's only integer tensors: gather/scatter indices) happens once per
    step instead of once per layer.
    """
    cache = md.__dict__.setdefault(_STEP_INDICES, {})
    index = cache.get(key)
    if index is None:
        index = cache[key] = build()
    return index


@spyre_oot(MambaMixer2)
class SpyreMambaMixer2(MambaMixer2):
    """``MambaMixer2`` with its conv + scan step in PyTorch (see the module docstring)."""

    def get_state_shape(self) -> tuple[tuple[int, ...], ...]:
        # The states vLLM allocates for this layer; the model class reports the
        # same padded shapes for vLLM's page-size planning
        # (spyre_inference.models.granitemoehybrid).
        return stick_padded_state_shapes(tuple(super().get_state_shape()))

    def conv_ssm_forward(self, projected_states: torch.Tensor, output: torch.Tensor) -> None:
        forward_context = get_forward_context()
        metadata_by_layer = forward_context.attn_metadata
        md: Any = None
        if isinstance(metadata_by_layer, dict):
            md = metadata_by_layer.get(self.prefix)
        if md is None:
            # A dummy or warm-up run without metadata: vLLM's own path would
            # autotune Triton kernels here. The output rows are defined (zero)
            # so the block graph after this op sees finite values.
            output.zero_()
            return
        if self.num_spec:
            raise NotImplementedError("speculative decoding with Mamba layers is not supported")
        if getattr(md, "checkpoint_chunk_idx", None) is not None:
            raise NotImplementedError("Mamba prefix-caching checkpoints are not supported")

        tp_inter = self.tped_intermediate_size
        xbc, dt_raw = torch.split(
            projected_states[..., tp_inter:], [self.tped_conv_size, self.tped_dt_size], dim=-1
        )
        conv_state = self.kv_cache[0]
        if conv_state.shape[-1] != self.conv_kernel_size - 1:
            # vLLM stores it (slot, width - 1, dim) unless dim-first is configured.
            conv_state = conv_state.transpose(-1, -2)
        ssm_state = self.kv_cache[1]
        weight = self.conv_weights
        bias = self.conv1d.bias
        heads = self.num_heads // self.tp_size
        groups = self.n_groups // self.tp_size
        inter, gstate = self.tped_intermediate_size, self.groups_ssm_state_size // self.tp_size

        num_d, num_p = md.num_decode_tokens, md.num_prefill_tokens
        actual = num_d + num_p

        # Stick-padded widths (stick_padded_state_shapes): the conv runs over
        # conv_width channels (zero input, weight and bias on the pad), the scan
        # over head_width x state_width (zero x, B and C on the pad, so the pad
        # of the state stays zero and adds nothing to y).
        conv_width = conv_state.shape[-2]
        head_width, state_width = ssm_state.shape[-2:]
        weight = _pad_last(weight.t(), conv_width).t()
        bias = None if bias is None else _pad_last(bias, conv_width)
        xbc = _pad_last(xbc, conv_width)

        def split_xbc(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
            pad = conv_width - inter - 2 * gstate
            xs, b, c, _ = torch.split(t, [inter, gstate, gstate, pad], dim=-1)
            n = t.shape[0]
            return (
                _pad_last(xs.view(n, heads, self.head_dim), head_width),
                _pad_last(b.view(n, groups, -1), state_width),
                _pad_last(c.view(n, groups, -1), state_width),
            )

        cdt = compute_dtype(xbc.dtype)
        if num_d:
            index = _step_index(md, "decode", lambda: self._decode_index(md, num_d))
            # Conv: the window is the stored width-1 inputs plus this token.
            window = torch.cat(
                (conv_state.index_select(0, index).to(xbc.dtype), xbc[:num_d].unsqueeze(-1)),
                dim=-1,
            )  # [S, dim, width]
            conv = (window.to(cdt) * weight.to(cdt)).sum(-1)
            if bias is not None:
                conv = conv + bias.to(cdt)
            conv_state.index_copy_(0, index, window[..., 1:].to(conv_state.dtype))
            xs, b, c = split_xbc(F.silu(conv))
            y, new = ssd_step(
                ssm_state.index_select(0, index),
                xs,
                _dt(dt_raw[:num_d], self.dt_bias, cdt),
                self.A,
                b,
                c,
                self.D,
            )
            ssm_state.index_copy_(0, index, new.to(ssm_state.dtype))
            output[:num_d].copy_(y[..., : self.head_dim].reshape(num_d, -1))

        if num_p:
            starts = _host_ints(md.query_start_loc_p)
            slots = _host_ints(md.state_indices_tensor_p)
            initial = (
                [bool(v) for v in md.has_initial_states_p.tolist()]
                if md.has_initial_states_p is not None
                else [False] * len(slots)
            )
            for i, slot in enumerate(slots):
                lo, hi = num_d + starts[i], num_d + starts[i + 1]
                if hi == lo:
                    continue
                conv_in = conv_state[slot] if initial[i] else None
                conv_out, conv_after = causal_conv1d(xbc[lo:hi], weight, bias, conv_in, cdt)
                conv_state[slot].copy_(conv_after.to(conv_state.dtype))
                xs, b, c = split_xbc(conv_out)
                y, final = ssd_scan(
                    xs,
                    _dt(dt_raw[lo:hi], self.dt_bias, cdt),
                    self.A,
                    b,
                    c,
                    self.D,
                    ssm_state[slot] if initial[i] else None,
                )
                ssm_state[slot].copy_(final.to(ssm_state.dtype))
                output[lo:hi].copy_(y[..., : self.head_dim].reshape(hi - lo, -1))

        if actual < output.shape[0]:
            # Padding rows of the step's bucket: zero, not left uninitialised
            # (they flow on into K/V written to the null block).
            output[actual:].zero_()

    @staticmethod
    def _decode_index(md: Any, num_decodes: int) -> torch.Tensor:
        """The decodes' state slots as a device index (one token per decode)."""
        slots = _host_ints(md.state_indices_tensor_d)[: md.num_decodes]
        if len(slots) != num_decodes:
            raise NotImplementedError("Mamba decode steps of more than one token")
        return dev.to_device(torch.tensor(slots, dtype=torch.int64))


__all__ = [
    "CHUNK",
    "SpyreMambaMixer2",
    "causal_conv1d",
    "ssd_scan",
    "ssd_step",
    "stick_padded_state_shapes",
]
