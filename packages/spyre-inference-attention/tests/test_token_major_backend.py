"""The token-major backend against plain PyTorch attention.

Every case is driven the way vLLM's runner drives a backend: a cache allocated
by vLLM's own ``create_kv_cache_views`` in the layout the backend declares,
context tokens already in (randomly placed) pages, a ``CommonAttentionMetadata``
turned into metadata by the backend's builder, then ``do_kv_cache_update`` and
``forward`` on the impl. The reference is dense
``torch.nn.functional.scaled_dot_product_attention`` in float64 over each
sequence's ground-truth K/V with the causal offset of its cached context (an
explicit softmax only where SDPA has no knob: logits soft-cap).

Unused cache memory, the null block included, is filled with large finite
garbage so a page or slot that should be masked but is not shows up as a wrong
result rather than passing by luck.
"""

from __future__ import annotations

import dataclasses
import importlib

import pytest
import torch
import torch.nn.functional as F
from vllm.config import set_current_vllm_config
from vllm.v1.attention.backend import CommonAttentionMetadata
from vllm.v1.attention.backends.registry import AttentionBackendEnum
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheLayout,
    KVCacheTensor,
    compute_layout_strides,
    create_kv_cache_views,
)

from spyre_inference.attention.backends.token_major import (
    NULL_BLOCK,
    SpyreAttentionBackend,
    SpyreAttentionImpl,
    SpyreAttentionMetadataBuilder,
)
from spyre_inference.attention.ops import slot_major_view
from spyre_inference.platform import discovery

#: float32 against a float64 reference: only summation order differs.
FP32_TOL = {"atol": 5e-6, "rtol": 1e-5}
#: bfloat16: Q.K^T and P.V run in bfloat16 (as the card runs them in float16),
#: so scores and probabilities carry bf16 rounding (8 mantissa bits, ~0.4%).
BF16_TOL = {"atol": 3e-2, "rtol": 3e-2}

GARBAGE = 1.0e3


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


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
    kv_cache: torch.Tensor  # logical [B, KVH, N, 2D] view (LBNHC strides)
    common: CommonAttentionMetadata
    spec: FullAttentionSpec
    block_table: torch.Tensor
    k_full: list[torch.Tensor]  # per sequence, [seq_len, KVH, D]
    v_full: list[torch.Tensor]
    q_rows: list[torch.Tensor]  # per sequence, [query_len, H, D]

    @property
    def num_actual_tokens(self) -> int:
        return sum(self.case.query_lens)


def allocate_layer_cache(spec: FullAttentionSpec, num_blocks: int) -> torch.Tensor:
    """One layer's cache through vLLM's own view code, in the backend's layout."""
    (layout,) = SpyreAttentionBackend.supported_kv_cache_layouts()
    raw = torch.zeros(num_blocks * spec.page_size_bytes, dtype=torch.int8)
    layer_stride, block_stride, *_ = compute_layout_strides(spec, num_blocks, 1, layout)
    tensor = KVCacheTensor(
        size=raw.numel(), layers=["layer.0"], layer_stride=layer_stride, block_stride=block_stride
    )
    (view,) = create_kv_cache_views(raw, spec, num_blocks, layout, tensor)
    return view


def prepare(case: Case, block_size: int) -> Step:
    gen = torch.Generator().manual_seed(case.seed)
    H, KVH, D = case.num_heads, case.num_kv_heads, case.head_size

    def randn(*shape: int, gain: float = 1.0) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen) * gain).to(case.dtype)

    blocks_per_seq = [cdiv(s, block_size) for s in case.seq_lens]
    num_blocks = 1 + sum(blocks_per_seq) + case.spare_blocks  # block 0: the null block
    spec = FullAttentionSpec(block_size=block_size, num_kv_heads=KVH, head_size=D, dtype=case.dtype)
    kv_cache = allocate_layer_cache(spec, num_blocks)
    kv_cache.copy_(randn(*kv_cache.shape, gain=GARBAGE))

    # Pages of all sequences in a random order over blocks 1.. (0 stays null).
    perm = (torch.randperm(num_blocks - 1, generator=gen) + 1).tolist()
    block_table = torch.zeros((len(case.seq_lens), max(blocks_per_seq) + 2), dtype=torch.int32)
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


def make_impl(vllm_config, case: Case) -> SpyreAttentionImpl:
    # Impls capture the current config at construction, as during model loading.
    with set_current_vllm_config(vllm_config):
        return SpyreAttentionImpl(
            num_heads=case.num_heads,
            head_size=case.head_size,
            scale=case.head_size**-0.5,
            num_kv_heads=case.num_kv_heads,
            alibi_slopes=None,
            sliding_window=case.sliding_window,
            kv_cache_dtype="auto",
            logits_soft_cap=case.soft_cap,
        )


def run_backend(vllm_config, step: Step) -> torch.Tensor:
    builder = SpyreAttentionMetadataBuilder(
        step.spec, ["layer.0"], vllm_config, torch.device("cpu")
    )
    metadata = builder.build(common_prefix_len=0, common_attn_metadata=step.common)
    impl = make_impl(vllm_config, step.case)
    impl.do_kv_cache_update(None, step.key, step.value, step.kv_cache, metadata.slot_mapping)
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
    outs = []
    for q, k, v in zip(step.q_rows, step.k_full, step.v_full, strict=True):
        q64 = q.double().transpose(0, 1)  # [H, q_len, D]
        k64 = k.double().repeat_interleave(groups, dim=1).transpose(0, 1)  # [H, seq, D]
        v64 = v.double().repeat_interleave(groups, dim=1).transpose(0, 1)
        keep = visible(q.shape[0], k.shape[0], case.sliding_window)
        if case.soft_cap is None:
            out = F.scaled_dot_product_attention(q64, k64, v64, attn_mask=keep, scale=scale)
        else:
            scores = q64 @ k64.transpose(-1, -2) * scale
            scores = case.soft_cap * torch.tanh(scores / case.soft_cap)
            probs = scores.masked_fill(~keep, float("-inf")).softmax(dim=-1)
            out = probs @ v64
        outs.append(out.transpose(0, 1))
    return torch.cat(outs)


def check(vllm_config, case: Case) -> None:
    block_size = vllm_config.cache_config.block_size
    step = prepare(case, block_size)
    out = run_backend(vllm_config, step)
    n = step.num_actual_tokens
    ref = reference(step)
    tol = FP32_TOL if case.dtype == torch.float32 else BF16_TOL
    assert out.dtype == case.dtype
    torch.testing.assert_close(out[:n].double(), ref, **tol)
    # Padding rows of the step are zeroed, never left as garbage.
    assert torch.equal(out[n:], torch.zeros_like(out[n:]))


# ---- workloads --------------------------------------------------------------

WORKLOADS = {
    "single_decode": ([200], [1]),
    "single_prefill": ([50], [50]),
    "many_decodes": ([10, 65, 130, 257, 64, 1], [1, 1, 1, 1, 1, 1]),
    "small_prefills": ([5, 17, 33, 2], [5, 17, 33, 2]),
    "mixed": ([300, 40, 129, 7, 65], [1, 40, 1, 7, 1]),
    "prefix_cached": ([150, 200, 128 + 9], [22, 50, 9]),
    "prefix_cached_block_aligned": ([192, 70], [64, 6]),
    "long_context": ([1500, 1000], [1, 60]),
}


@pytest.mark.parametrize("workload", sorted(WORKLOADS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_matches_dense_reference(vllm_config, workload, dtype):
    seq_lens, query_lens = WORKLOADS[workload]
    check(vllm_config, Case(seq_lens, query_lens, dtype=dtype))


@pytest.mark.parametrize(
    ("num_heads", "num_kv_heads"),
    [(4, 4), (4, 2), (8, 2), (8, 1)],
    ids=["mha", "gqa2", "gqa4", "mqa"],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_head_grouping(vllm_config, num_heads, num_kv_heads, dtype):
    seq_lens, query_lens = WORKLOADS["mixed"]
    check(
        vllm_config,
        Case(seq_lens, query_lens, num_heads=num_heads, num_kv_heads=num_kv_heads, dtype=dtype),
    )


@pytest.mark.parametrize("window", [1, 5, 64, 100])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_sliding_window(vllm_config, window, dtype):
    # Long enough that whole pages fall before the window for the decodes,
    # and prefills whose rows see a window inside their own chunk.
    check(
        vllm_config,
        Case([300, 40, 200, 7], [1, 40, 30, 7], sliding_window=window, dtype=dtype),
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_logits_soft_cap(vllm_config, dtype):
    # A query gain that pushes scores well past the cap, so capping matters.
    check(
        vllm_config,
        Case([300, 40, 150], [1, 40, 22], soft_cap=5.0, query_gain=6.0, dtype=dtype),
    )


def test_soft_cap_and_window_together(vllm_config):
    check(vllm_config, Case([260, 50], [3, 50], sliding_window=33, soft_cap=4.0, query_gain=5.0))


def test_head_size_64(vllm_config):
    """The spec's smallest real head size (one stick), GQA, mixed step."""
    check(vllm_config, Case([130, 20], [1, 20], num_heads=4, num_kv_heads=2, head_size=64))


def test_softcap_reference_matches_sdpa():
    """The explicit soft-cap reference reduces to SDPA as the cap grows."""
    gen = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(2, 5, 8, generator=gen, dtype=torch.float64) for _ in range(3))
    keep = visible(5, 5, None)
    scores = q @ k.transpose(-1, -2) * 8**-0.5
    cap = 1e6
    probs = (cap * torch.tanh(scores / cap)).masked_fill(~keep, float("-inf")).softmax(-1)
    torch.testing.assert_close(
        probs @ v, F.scaled_dot_product_attention(q, k, v, attn_mask=keep, scale=8**-0.5)
    )


def test_decode_steps_accumulate_in_cache(vllm_config):
    """Three consecutive decode steps: each step's token is read back by the next."""
    block_size = vllm_config.cache_config.block_size
    case = Case([63], [1], pad_tokens=0)
    step = prepare(case, block_size)
    impl = make_impl(vllm_config, case)
    builder = SpyreAttentionMetadataBuilder(
        step.spec, ["layer.0"], vllm_config, torch.device("cpu")
    )
    gen = torch.Generator().manual_seed(7)
    k_all, v_all = step.k_full[0], step.v_full[0]
    table = step.block_table[0]
    # The sequence crosses into a second page on the second step.
    table[1] = next(b for b in range(1, 5) if b != int(table[0]))  # a spare block
    for seq_len in (63, 64, 65):
        q = torch.randn(1, 4, 16, generator=gen)
        if seq_len > 63:
            k_new = torch.randn(1, 2, 16, generator=gen)
            v_new = torch.randn(1, 2, 16, generator=gen)
            k_all = torch.cat([k_all, k_new])
            v_all = torch.cat([v_all, v_new])
        else:
            k_new, v_new = k_all[-1:], v_all[-1:]
        pos = seq_len - 1
        slot = int(table[pos // block_size]) * block_size + pos % block_size
        common = dataclasses.replace(
            step.common,
            seq_lens=torch.tensor([seq_len], dtype=torch.int32),
            seq_lens_cpu_upper_bound=torch.tensor([seq_len], dtype=torch.int32),
            max_seq_len=seq_len,
            slot_mapping=torch.tensor([slot], dtype=torch.int64),
        )
        metadata = builder.build(0, common)
        impl.do_kv_cache_update(None, k_new, v_new, step.kv_cache, metadata.slot_mapping)
        out = impl.forward(
            None, q, k_new, v_new, step.kv_cache, metadata, output=torch.empty_like(q)
        )
        ref = F.scaled_dot_product_attention(
            q.transpose(0, 1).double(),
            k_all.repeat_interleave(2, dim=1).transpose(0, 1).double(),
            v_all.repeat_interleave(2, dim=1).transpose(0, 1).double(),
            scale=16**-0.5,
        ).transpose(0, 1)
        torch.testing.assert_close(out.double(), ref, **FP32_TOL)


# ---- the KV store -----------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_kv_write_puts_each_token_at_its_slot(vllm_config, dtype):
    block_size = vllm_config.cache_config.block_size
    case = Case(*WORKLOADS["mixed"], dtype=dtype, pad_tokens=5)
    step = prepare(case, block_size)
    before = step.kv_cache.clone()
    impl = make_impl(vllm_config, case)
    impl.do_kv_cache_update(None, step.key, step.value, step.kv_cache, step.common.slot_mapping)

    D = case.head_size
    expected = before.clone()
    n = step.num_actual_tokens
    for t, slot in enumerate(step.common.slot_mapping[:n].tolist()):
        blk, off = divmod(slot, block_size)
        # Exact equality: the store is a copy, not arithmetic.
        assert torch.equal(step.kv_cache[blk, :, off, :D], step.key[t])
        assert torch.equal(step.kv_cache[blk, :, off, D:], step.value[t])
        expected[blk, :, off, :D] = step.key[t]
        expected[blk, :, off, D:] = step.value[t]
    # Padding tokens went to the null block; nothing else changed.
    changed_outside = step.kv_cache[NULL_BLOCK + 1 :] != expected[NULL_BLOCK + 1 :]
    assert not changed_outside.any()
    assert torch.equal(step.kv_cache[NULL_BLOCK, :, 1:], before[NULL_BLOCK, :, 1:])


def test_under_inference_mode(vllm_config):
    """The runner executes under torch.inference_mode, where new tensors have
    no version counter: the slot mapping of each step is one of those."""
    block_size = vllm_config.cache_config.block_size
    case = Case(*WORKLOADS["mixed"])
    step = prepare(case, block_size)
    with torch.inference_mode():
        step.common.slot_mapping = step.common.slot_mapping.clone()
        assert step.common.slot_mapping.is_inference()
        out = run_backend(vllm_config, step)
    n = step.num_actual_tokens
    torch.testing.assert_close(out[:n].double(), reference(step), **FP32_TOL)


def test_kv_write_follows_new_slot_mapping_each_step(vllm_config):
    """The per-step slot-index cache must not serve a stale index."""
    block_size = vllm_config.cache_config.block_size
    case = Case([10], [2], pad_tokens=0)
    step = prepare(case, block_size)
    impl = make_impl(vllm_config, case)
    slot_buffer = torch.tensor([block_size + 3, block_size + 4], dtype=torch.int64)
    k1 = torch.ones(2, 2, 16)
    impl.do_kv_cache_update(None, k1, k1, step.kv_cache, slot_buffer)
    # The runner rewrites its persistent buffer in place for the next step.
    slot_buffer.copy_(torch.tensor([2 * block_size + 7, 2 * block_size + 8]))
    k2 = torch.full((2, 2, 16), 2.0)
    impl.do_kv_cache_update(None, k2, k2, step.kv_cache, slot_buffer)
    assert torch.equal(step.kv_cache[2, :, 7], torch.full((2, 32), 2.0))
    assert torch.equal(step.kv_cache[2, :, 8], torch.full((2, 32), 2.0))
    assert torch.equal(step.kv_cache[1, :, 3], torch.ones(2, 32))


def test_slot_major_view_rejects_head_major_cache():
    spec = FullAttentionSpec(block_size=64, num_kv_heads=2, head_size=16, dtype=torch.float32)
    raw = torch.zeros(4 * spec.page_size_bytes, dtype=torch.int8)
    layout = KVCacheLayout.LBHNC
    layer_stride, block_stride, *_ = compute_layout_strides(spec, 4, 1, layout)
    tensor = KVCacheTensor(
        size=raw.numel(), layers=["l"], layer_stride=layer_stride, block_stride=block_stride
    )
    (head_major,) = create_kv_cache_views(raw, spec, 4, layout, tensor)
    with pytest.raises(ValueError, match="LBNHC"):
        slot_major_view(head_major)


def test_slot_major_view_is_a_view_of_vllm_allocation():
    spec = FullAttentionSpec(block_size=64, num_kv_heads=2, head_size=16, dtype=torch.float32)
    cache = allocate_layer_cache(spec, 4)
    slots = slot_major_view(cache)
    assert slots.shape == (4 * 64, 2, 32)
    assert slots.data_ptr() == cache.data_ptr()
    slots[2 * 64 + 5] = 7.0
    assert torch.equal(cache[2, :, 5], torch.full((2, 32), 7.0))
    # The backend's own allocator yields the same strides.
    own = SpyreAttentionBackend.allocate_pages(spec, 4, "cpu")
    assert own.shape == cache.shape and own.stride() == cache.stride()


# ---- the backend class as vLLM and the platform see it ----------------------


def test_backend_declarations():
    backend = SpyreAttentionBackend
    assert AttentionBackendEnum[backend.get_name()] is AttentionBackendEnum.CUSTOM
    assert backend.forward_includes_kv_cache_update is False
    assert backend.supported_kv_cache_layouts() == (KVCacheLayout.LBNHC,)
    assert backend.supports_block_size(64) and backend.supports_block_size(128)
    assert not backend.supports_block_size(16)
    assert backend.supports_head_size(64) and backend.supports_head_size(256)
    assert not backend.supports_head_size(80)
    assert backend.supports_sliding_window()
    assert backend.supports_dtype(torch.float16) and backend.supports_dtype(torch.bfloat16)


def test_entry_point_resolves_to_backend():
    qualname = discovery.resolve_qualname(
        discovery.ATTENTION_BACKENDS_GROUP, "token_major", "the attention backend"
    )
    module, _, name = qualname.rpartition(".")
    assert getattr(importlib.import_module(module), name) is SpyreAttentionBackend


def test_profiling_run_without_metadata_returns_zeros(vllm_config):
    impl = make_impl(vllm_config, Case([1], [1]))
    out = torch.full((3, 4, 16), float("nan"))
    q = torch.randn(3, 4, 16)
    result = impl.forward(None, q, q[:, :2], q[:, :2], torch.tensor([]), None, output=out)
    assert torch.equal(result, torch.zeros_like(out))


def test_unsupported_features_fail_loudly(vllm_config):
    with set_current_vllm_config(vllm_config), pytest.raises(NotImplementedError, match="ALiBi"):
        SpyreAttentionImpl(4, 16, 0.25, 2, alibi_slopes=[1.0] * 4)
    with (
        set_current_vllm_config(vllm_config),
        pytest.raises(NotImplementedError, match="kv_cache_dtype"),
    ):
        SpyreAttentionImpl(4, 16, 0.25, 2, kv_cache_dtype="fp8")


# ---- through vLLM's own Attention layer --------------------------------------


@pytest.mark.parametrize("window", [None, 40], ids=["full", "window40"])
def test_through_vllm_attention_layer(vllm_config, window):
    """vLLM's Attention layer drives the backend: KV-update op, then attention op.

    The layer resolves the enum member from ``get_name()``, binds the cache,
    and reads metadata and slot mapping from the forward context, exactly as in
    a model forward.
    """
    from vllm.forward_context import set_forward_context
    from vllm.model_executor.layers.attention import Attention

    name = f"model.layers.{0 if window is None else 1}.self_attn.attn"
    case = Case(*WORKLOADS["mixed"], sliding_window=window)
    with set_current_vllm_config(vllm_config):
        layer = Attention(
            num_heads=case.num_heads,
            head_size=case.head_size,
            scale=case.head_size**-0.5,
            num_kv_heads=case.num_kv_heads,
            per_layer_sliding_window=window,
            cache_config=vllm_config.cache_config,
            prefix=name,
            attn_backend=SpyreAttentionBackend,
        )
    assert layer.backend is AttentionBackendEnum.CUSTOM
    assert isinstance(layer.impl, SpyreAttentionImpl)

    step = prepare(case, vllm_config.cache_config.block_size)
    layer.bind_kv_cache(step.kv_cache)
    builder = SpyreAttentionMetadataBuilder(step.spec, [name], vllm_config, torch.device("cpu"))
    metadata = builder.build(0, step.common)
    # The builder prepared the mask tiles of its layers' window up front.
    assert window in metadata._masks

    tokens = step.query.shape[0]
    with set_forward_context(
        {name: metadata}, vllm_config, slot_mapping={name: step.common.slot_mapping}
    ):
        out = layer(
            step.query.reshape(tokens, -1),
            step.key.reshape(tokens, -1),
            step.value.reshape(tokens, -1),
        )
    n = step.num_actual_tokens
    out = out.view(tokens, case.num_heads, case.head_size)
    torch.testing.assert_close(out[:n].double(), reference(step), **FP32_TOL)


# ---- the builder's plan -------------------------------------------------------


def test_builder_pads_onto_buckets_and_skips_padding_requests(vllm_config):
    block_size = vllm_config.cache_config.block_size
    case = Case([300, 40, 129], [1, 40, 1], pad_tokens=0)
    step = prepare(case, block_size)
    # A padding request (query length 0) after the real ones, as the runner adds.
    common = dataclasses.replace(
        step.common,
        query_start_loc=torch.cat([step.common.query_start_loc, step.common.query_start_loc[-1:]]),
        query_start_loc_cpu=torch.cat(
            [step.common.query_start_loc_cpu, step.common.query_start_loc_cpu[-1:]]
        ),
        seq_lens=torch.cat([step.common.seq_lens, torch.zeros(1, dtype=torch.int32)]),
        block_table_tensor=torch.cat([step.block_table, torch.zeros_like(step.block_table[:1])]),
        num_reqs=4,
    )
    builder = SpyreAttentionMetadataBuilder(
        step.spec, ["layer.0"], vllm_config, torch.device("cpu")
    )
    metadata = builder.build(0, common)
    assert [s.query_len for s in metadata.seqs] == [1, 40, 1]
    # max_num_batched_tokens=64: query buckets [1, 64]; 2048/64 = 32 pages: [1, 2, 4, ..., 32].
    assert [s.query_bucket for s in metadata.seqs] == [1, 64, 1]
    assert [s.kv_block_bucket for s in metadata.seqs] == [8, 1, 4]  # 5, 1, 3 pages used
    seq = metadata.seqs[0]
    assert seq.q_index.tolist() == [0]
    assert seq.block_ids.shape == (8, 1)
    assert seq.block_ids[:5, 0].tolist() == step.block_table[0, :5].tolist()
    assert set(seq.block_ids[5:, 0].tolist()) == {NULL_BLOCK}
    prefill = metadata.seqs[1]
    assert prefill.q_index.tolist() == list(range(1, 41)) + [1] * 24
    mask = metadata.tile_masks(None)[1]
    assert mask.shape == (64, 64) and mask.dtype == torch.float32
    # Row 39 (the last real one) sees keys 0..39; padded rows see nothing.
    assert (mask[39, :40] == 0).all() and (mask[39, 40:] < -1e30).all()
    assert (mask[40:] < -1e30).all()
