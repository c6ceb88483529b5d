"""Shared helpers of the decoder-backend tests: steps, caches and the dense reference.

Every case is driven the way vLLM's runner drives a backend: a cache allocated
by vLLM's own ``create_kv_cache_views`` in the layout the backend declares,
context tokens already in (randomly placed) pages, a ``CommonAttentionMetadata``
turned into metadata by the backend's builder, then ``forward`` on the impl
(which stores the step's K/V first, as vLLM drives it). The reference is dense
``torch.nn.functional.scaled_dot_product_attention`` in float64 over each
sequence's ground-truth K/V with the causal offset of its cached context (an
explicit softmax only where SDPA has no knob: logits soft-cap, ALiBi).

Unused cache memory, the null block included, is filled with large finite
garbage so a page or slot that should be masked but is not shows up as a wrong
result rather than passing by luck.
"""

from __future__ import annotations

import dataclasses
import types

import torch
import torch.nn.functional as F
from vllm.config import set_current_vllm_config
from vllm.v1.attention.backend import CommonAttentionMetadata
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheTensor,
    compute_layout_strides,
    create_kv_cache_views,
)

#: float32 against a float64 reference: only summation order differs.
FP32_TOL = {"atol": 5e-6, "rtol": 1e-5}
#: bfloat16: Q.K^T and P.V run in bfloat16 (as the card runs them in float16),
#: so scores and probabilities carry bf16 rounding (8 mantissa bits, ~0.4%).
BF16_TOL = {"atol": 3e-2, "rtol": 3e-2}

GARBAGE = 1.0e3


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def alibi_slopes(num_heads: int) -> list[float]:
    """The ALiBi paper's geometric slopes (power-of-two head counts)."""
    start = 2.0 ** (-8.0 / num_heads)
    return [start ** (i + 1) for i in range(num_heads)]


def sink_logits(num_heads: int, seed: int) -> torch.Tensor:
    """Seeded per-head sink logits, float32, on the scale of the scores (so that
    they take a real share of each row's probability)."""
    gen = torch.Generator().manual_seed(seed + 7919)
    return torch.randn(num_heads, generator=gen) * 2.0


@dataclasses.dataclass
class Case:
    seq_lens: list[int]
    query_lens: list[int]
    num_heads: int = 4
    num_kv_heads: int = 2
    head_size: int = 16
    dtype: torch.dtype = torch.float32
    sliding_window: int | None = None
    soft_cap: float | None = None
    alibi: bool = False
    #: per-head attention-sink logits (gpt-oss), from :func:`sink_logits`
    sinks: bool = False
    #: padded token rows after the real ones (the runner's num_tokens bucket)
    pad_tokens: int = 3
    #: spare blocks that hold no sequence (garbage that must never be read)
    spare_blocks: int = 3
    query_gain: float = 1.0
    seed: int = 0


@dataclasses.dataclass
class Step:
    """One prepared step: inputs, the cache, the metadata, the ground truth."""

    case: Case
    query: torch.Tensor  # [T, H, D] incl. padding rows
    key: torch.Tensor  # [T, KVH, D]
    value: torch.Tensor
    kv_cache: torch.Tensor  # logical [B, KVH, N, 2D] view (backend layout strides)
    common: CommonAttentionMetadata
    spec: FullAttentionSpec
    block_table: torch.Tensor
    k_full: list[torch.Tensor]  # per sequence, [seq_len, KVH, D]
    v_full: list[torch.Tensor]
    q_rows: list[torch.Tensor]  # per sequence, [query_len, H, D]

    @property
    def num_actual_tokens(self) -> int:
        return sum(self.case.query_lens)


def allocate_layer_cache(backend, spec: FullAttentionSpec, num_blocks: int) -> torch.Tensor:
    """One layer's cache through vLLM's own view code, in the backend's layout."""
    (layout,) = backend.supported_kv_cache_layouts()
    raw = torch.zeros(num_blocks * spec.page_size_bytes, dtype=torch.int8)
    layer_stride, block_stride, *_ = compute_layout_strides(spec, num_blocks, 1, layout)
    tensor = KVCacheTensor(
        size=raw.numel(), layers=["layer.0"], layer_stride=layer_stride, block_stride=block_stride
    )
    (view,) = create_kv_cache_views(raw, spec, num_blocks, layout, tensor)
    return view


def prepare(backend, case: Case, block_size: int) -> Step:
    gen = torch.Generator().manual_seed(case.seed)
    H, KVH, D = case.num_heads, case.num_kv_heads, case.head_size

    def randn(*shape: int, gain: float = 1.0) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen) * gain).to(case.dtype)

    blocks_per_seq = [cdiv(s, block_size) for s in case.seq_lens]
    num_blocks = 1 + sum(blocks_per_seq) + case.spare_blocks  # block 0: the null block
    spec = FullAttentionSpec(block_size=block_size, num_kv_heads=KVH, head_size=D, dtype=case.dtype)
    kv_cache = allocate_layer_cache(backend, spec, num_blocks)
    kv_cache.copy_(randn(*kv_cache.shape, gain=GARBAGE))

    # Pages of all sequences in a random order over blocks 1.. (0 stays null).
    perm = (torch.randperm(num_blocks - 1, generator=gen) + 1).tolist()
    block_table = torch.zeros((len(case.seq_lens), max(blocks_per_seq) + 2), dtype=torch.int32)
    # Stale ids past each sequence's pages (as a reused block-table row has):
    # they must never be read.
    block_table[:, :] = torch.tensor(perm[-1], dtype=torch.int32)
    k_full, v_full, q_rows = [], [], []
    slots, queries, keys, values = [], [], [], []
    for i, (seq_len, q_len) in enumerate(zip(case.seq_lens, case.query_lens, strict=True)):
        n = blocks_per_seq[i]
        block_table[i, :n] = torch.tensor(perm[:n], dtype=torch.int32)
        perm = perm[n:]
        k, v = randn(seq_len, KVH, D), randn(seq_len, KVH, D)
        k_full.append(k)
        v_full.append(v)
        q = randn(q_len, H, D, gain=case.query_gain)
        q_rows.append(q)
        ctx = seq_len - q_len
        pos = torch.arange(seq_len)
        blk = block_table[i, pos // block_size].long()
        off = pos % block_size
        # The cached context goes in through vLLM's logical view; new tokens
        # arrive through the backend's KV store.
        kv_cache[blk[:ctx], :, off[:ctx], :D] = k[:ctx]
        kv_cache[blk[:ctx], :, off[:ctx], D:] = v[:ctx]
        slots.append(blk[ctx:] * block_size + off[ctx:])
        queries.append(q)
        keys.append(k[ctx:])
        values.append(v[ctx:])

    pad = case.pad_tokens
    query = torch.cat([*queries, randn(pad, H, D)])
    key = torch.cat([*keys, randn(pad, KVH, D)])
    value = torch.cat([*values, randn(pad, KVH, D)])
    slot_mapping = torch.cat([*slots, torch.full((pad,), -1, dtype=torch.int64)])

    query_start_loc = torch.zeros(len(case.query_lens) + 1, dtype=torch.int32)
    query_start_loc[1:] = torch.tensor(case.query_lens).cumsum(0)
    seq_lens = torch.tensor(case.seq_lens, dtype=torch.int32)
    common = CommonAttentionMetadata(
        query_start_loc=query_start_loc,
        query_start_loc_cpu=query_start_loc.clone(),
        seq_lens=seq_lens,
        seq_lens_cpu_upper_bound=seq_lens.clone(),
        num_reqs=len(case.seq_lens),
        num_actual_tokens=sum(case.query_lens),
        max_query_len=max(case.query_lens),
        max_seq_len=max(case.seq_lens),
        block_table_tensor=block_table,
        slot_mapping=slot_mapping,
        causal=True,
    )
    return Step(
        case, query, key, value, kv_cache, common, spec, block_table, k_full, v_full, q_rows
    )


def make_impl(backend, vllm_config, case: Case):
    # Impls capture the current config at construction, as during model loading.
    with set_current_vllm_config(vllm_config):
        return backend.get_impl_cls()(
            num_heads=case.num_heads,
            head_size=case.head_size,
            scale=case.head_size**-0.5,
            num_kv_heads=case.num_kv_heads,
            alibi_slopes=alibi_slopes(case.num_heads) if case.alibi else None,
            sliding_window=case.sliding_window,
            kv_cache_dtype="auto",
            logits_soft_cap=case.soft_cap,
            sinks=sink_logits(case.num_heads, case.seed) if case.sinks else None,
        )


def run_backend(backend, vllm_config, step: Step, impl=None) -> torch.Tensor:
    impl = impl or make_impl(backend, vllm_config, step.case)
    # The layer is registered under its name, as vLLM's Attention layers are
    # while the model loads: the builder reads its impls from the forward
    # context to route rows (the cpu target's host decode and prefill paths),
    # and a bare builder would keep every row on the graphs.
    context = vllm_config.compilation_config.static_forward_context
    context["layer.0"] = types.SimpleNamespace(impl=impl)
    try:
        builder = backend.get_builder_cls()(
            step.spec, ["layer.0"], vllm_config, torch.device("cpu")
        )
        metadata = builder.build(common_prefix_len=0, common_attn_metadata=step.common)
    finally:
        del context["layer.0"]
    # forward stores the step's K/V first (forward_includes_kv_cache_update).
    output = torch.full_like(step.query, float("nan"))
    return impl.forward(
        None, step.query, step.key, step.value, step.kv_cache, metadata, output=output
    )


def visible(q_len: int, seq_len: int, window: int | None) -> torch.Tensor:
    """[q_len, seq_len] bool: causal with the context offset, optional window."""
    q_pos = torch.arange(q_len).unsqueeze(1) + (seq_len - q_len)
    k_pos = torch.arange(seq_len).unsqueeze(0)
    keep = k_pos <= q_pos
    if window is not None:
        keep &= (q_pos - k_pos) < window
    return keep


def reference(step: Step) -> torch.Tensor:
    """Dense attention per sequence in float64, concatenated over sequences."""
    case = step.case
    groups = case.num_heads // case.num_kv_heads
    scale = case.head_size**-0.5
    slopes = torch.tensor(alibi_slopes(case.num_heads), dtype=torch.float64)
    outs = []
    for q, k, v in zip(step.q_rows, step.k_full, step.v_full, strict=True):
        q64 = q.double().transpose(0, 1)  # [H, q_len, D]
        k64 = k.double().repeat_interleave(groups, dim=1).transpose(0, 1)  # [H, seq, D]
        v64 = v.double().repeat_interleave(groups, dim=1).transpose(0, 1)
        q_len, seq_len = q.shape[0], k.shape[0]
        keep = visible(q_len, seq_len, case.sliding_window)
        if case.soft_cap is None and not case.alibi and not case.sinks:
            out = F.scaled_dot_product_attention(q64, k64, v64, attn_mask=keep, scale=scale)
        else:
            scores = q64 @ k64.transpose(-1, -2) * scale
            if case.soft_cap is not None:
                scores = case.soft_cap * torch.tanh(scores / case.soft_cap)
            if case.alibi:
                q_pos = torch.arange(q_len).unsqueeze(1) + (seq_len - q_len)
                rel = (torch.arange(seq_len).unsqueeze(0) - q_pos).double()
                scores = scores + slopes.view(-1, 1, 1) * rel
            scores = scores.masked_fill(~keep, float("-inf"))
            if case.sinks:
                # gpt-oss: softmax over [scores, sink], the sink column dropped.
                sink = sink_logits(case.num_heads, case.seed).double()
                sink = sink.view(-1, 1, 1).expand(-1, q_len, 1)
                probs = torch.cat((scores, sink), dim=-1).softmax(dim=-1)[..., :-1]
            else:
                probs = scores.softmax(dim=-1)
            out = probs @ v64
        outs.append(out.transpose(0, 1))
    return torch.cat(outs)


def check(backend, vllm_config, case: Case) -> torch.Tensor:
    """Run ``case`` through ``backend`` and compare with the reference; returns the output."""
    block_size = vllm_config.cache_config.block_size
    step = prepare(backend, case, block_size)
    out = run_backend(backend, vllm_config, step)
    n = step.num_actual_tokens
    ref = reference(step)
    tol = FP32_TOL if case.dtype == torch.float32 else BF16_TOL
    assert out.dtype == case.dtype
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out[:n].double(), ref, **tol)
    # Padding rows of the step are zeroed, never left as garbage.
    assert torch.equal(out[n:], torch.zeros_like(out[n:]))
    return out


def reset_settings(monkeypatch, **env: str | None) -> None:
    """Set (or unset, with None) plugin environment variables and re-parse settings."""
    from spyre_inference.platform import settings

    for name, value in env.items():
        if value is None:
            monkeypatch.delenv(name, raising=False)
        else:
            monkeypatch.setenv(name, value)
    settings.reset_cache()
