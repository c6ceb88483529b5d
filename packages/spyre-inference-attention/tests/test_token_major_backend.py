"""Token-major specifics: the KV store, the cache views, declarations, the builder's plan.

The numerical matrix (workloads, GQA ratios, windows, soft-cap, ALiBi, compiled
graphs) runs against both decoder layouts in ``test_decoder_backends.py``.
"""

from __future__ import annotations

import dataclasses
import importlib

import pytest
import torch
import torch.nn.functional as F
from attn_testutil import (
    BF16_TOL,
    FP32_TOL,
    Case,
    allocate_layer_cache,
    reference,
    reset_settings,
    visible,
)
from attn_testutil import make_impl as _make_impl
from attn_testutil import prepare as _prepare
from attn_testutil import run_backend as _run_backend
from vllm.config import set_current_vllm_config
from vllm.v1.attention.backends.registry import AttentionBackendEnum
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheLayout,
    KVCacheTensor,
    compute_layout_strides,
    create_kv_cache_views,
)

from spyre_inference.attention.backends.paged import NULL_BLOCK
from spyre_inference.attention.backends.token_major import (
    SpyreAttentionBackend,
    SpyreAttentionImpl,
    SpyreAttentionMetadataBuilder,
)
from spyre_inference.attention.ops import slot_major_view
from spyre_inference.platform import discovery

BACKEND = SpyreAttentionBackend

WORKLOADS = {
    "mixed": ([300, 40, 129, 7, 65], [1, 40, 1, 7, 1]),
}


def prepare(case: Case, block_size: int):
    return _prepare(BACKEND, case, block_size)


def make_impl(vllm_config, case: Case) -> SpyreAttentionImpl:
    return _make_impl(BACKEND, vllm_config, case)


def run_backend(vllm_config, step) -> torch.Tensor:
    return _run_backend(BACKEND, vllm_config, step)


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
    """A runner that rewrites its slot-mapping buffer in place gets the new slots."""
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
    cache = allocate_layer_cache(BACKEND, spec, 4)
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
    assert backend.forward_includes_kv_cache_update is True
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
    with (
        set_current_vllm_config(vllm_config),
        pytest.raises(NotImplementedError, match="kv_cache_dtype"),
    ):
        SpyreAttentionImpl(4, 16, 0.25, 2, kv_cache_dtype="fp8")


# ---- through vLLM's own Attention layer --------------------------------------


def _attention_layer(vllm_config, case: Case, name: str, window: int | None = None):
    """A vLLM ``Attention`` layer on this backend with ``case``'s cache bound, and the
    step's metadata from the builder (which reads the registered layer, as in a model)."""
    from vllm.model_executor.layers.attention import Attention

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
    step = prepare(case, vllm_config.cache_config.block_size)
    layer.bind_kv_cache(step.kv_cache)
    builder = SpyreAttentionMetadataBuilder(step.spec, [name], vllm_config, torch.device("cpu"))
    return layer, step, builder.build(0, step.common)


def _forward(layer, name: str, metadata, step, vllm_config) -> torch.Tensor:
    """The layer's forward under vLLM's forward context: ``[tokens, heads, head_size]``."""
    from vllm.forward_context import set_forward_context

    tokens = step.query.shape[0]
    with set_forward_context(
        {name: metadata}, vllm_config, slot_mapping={name: step.common.slot_mapping}
    ):
        out = layer(
            step.query.reshape(tokens, -1),
            step.key.reshape(tokens, -1),
            step.value.reshape(tokens, -1),
        )
    return out.view(tokens, step.case.num_heads, step.case.head_size)


@pytest.mark.parametrize("window", [None, 40], ids=["full", "window40"])
def test_through_vllm_attention_layer(vllm_config, window):
    """vLLM's Attention layer drives the backend: KV-update op, then attention op.

    The layer resolves the enum member from ``get_name()``, binds the cache,
    and reads metadata and slot mapping from the forward context, exactly as in
    a model forward.
    """
    name = f"model.layers.{0 if window is None else 1}.self_attn.attn"
    case = Case(*WORKLOADS["mixed"], sliding_window=window)
    layer, step, metadata = _attention_layer(vllm_config, case, name, window)
    assert layer.backend is AttentionBackendEnum.CUSTOM
    assert isinstance(layer.impl, SpyreAttentionImpl)
    # The builder prepared the mask tiles of its layers' window up front.
    assert window in metadata._masks

    out = _forward(layer, name, metadata, step, vllm_config)
    n = step.num_actual_tokens
    torch.testing.assert_close(out[:n].double(), reference(step), **FP32_TOL)


def test_cpu_target_attends_rows_on_the_host_kernel(vllm_config, monkeypatch):
    """cpu target: decodes and a short prefill (7 rows) are host-kernel rows, attended
    in one call per layer; a 300-row chunk over 1600 cached tokens goes to the host
    flash kernel, unpadded and without a mask. No graph runs; the output equals plain
    PyTorch attention."""
    from spyre_inference.attention import policy
    from spyre_inference.attention.ops import host_decode, host_prefill

    reset_settings(monkeypatch, SPYRE_BATCHED_DECODE=None)
    case = Case([300, 1900, 129, 7], [1, 300, 1, 7], pad_tokens=2)
    if not policy.use_host_decode(
        None, False, case.dtype, case.head_size, case.num_heads, case.num_kv_heads
    ):
        pytest.skip("the host decode kernel is not used here")
    name = "model.layers.2.self_attn.attn"
    layer, step, metadata = _attention_layer(vllm_config, case, name)

    assert metadata.seqs == [] and metadata.decode is None
    block_size = vllm_config.cache_config.block_size
    [prefill] = metadata.host_prefills
    assert (prefill.query_start, prefill.query_len, prefill.context_len) == (1, 300, 1600)
    # Exactly the sequence's pages (1900 tokens), no bucket padding.
    assert prefill.block_ids.tolist() == step.block_table[1, : -(-1900 // block_size)].tolist()
    host = metadata.host
    assert host is not None and not host.leading
    # Query rows: request 0 is row 0, request 2 row 301, request 3 rows 302..308.
    assert host.rows.tolist() == [0, 301, *range(302, 309)]
    assert host.positions.tolist() == [299, 128, *range(7)]
    # Pages of the longest host sequence (300 tokens: 5 pages) onto their bucket (8).
    assert host.block_ids.shape == (9, 8)
    assert host.block_ids[0, :5].tolist() == step.block_table[0, :5].tolist()
    assert host.block_ids[1, :3].tolist() == step.block_table[2, :3].tolist()
    assert set(host.block_ids[1, 3:].tolist()) == {NULL_BLOCK}
    mask = metadata.host_mask(None)
    assert (mask[2, :1] == 0).all() and (mask[2, 1:] < -1e30).all()  # first prompt token

    calls = host_decode.calls(), host_prefill.calls()
    out = _forward(layer, name, metadata, step, vllm_config)
    assert (host_decode.calls(), host_prefill.calls()) == (calls[0] + 1, calls[1] + 1)
    n = step.num_actual_tokens
    torch.testing.assert_close(out[:n].double(), reference(step), **FP32_TOL)
    assert (out[n:] == 0).all()


def test_bf16_prefills_route_by_the_plugin_kernel_rule(vllm_config, monkeypatch):
    """cpu target, bfloat16, where the plugin's prefill kernel serves: a 192-row first
    chunk and a 20-row chunk after 1000 tokens take it, a 128-row first chunk and a
    7-row one stay decode-kernel rows (``policy.host_rows_win``); the step's output
    is plain PyTorch attention within bf16 rounding."""
    from spyre_inference.attention import policy
    from spyre_inference.attention.ops import host_prefill

    reset_settings(monkeypatch, SPYRE_BATCHED_DECODE=None, SPYRE_CPU_PREFILL_KERNEL="plugin")
    host_prefill.reset_for_tests()
    case = Case([192, 128, 1020, 7, 150], [192, 128, 20, 7, 1], head_size=64, dtype=torch.bfloat16)
    if host_prefill.kernel_unavailable_reason() or not policy.use_host_decode(
        None, False, case.dtype, case.head_size, case.num_heads, case.num_kv_heads
    ):
        pytest.skip("the host kernels are not used here")
    name = "model.layers.3.self_attn.attn"
    layer, step, metadata = _attention_layer(vllm_config, case, name)
    routed = [(p.query_start, p.query_len, p.context_len) for p in metadata.host_prefills]
    assert routed == [(0, 192, 0), (320, 20, 1000)]
    assert metadata.host is not None
    assert metadata.host.rows.tolist() == [*range(192, 320), *range(340, 347), 347]

    calls = host_prefill.kernel_calls()
    out = _forward(layer, name, metadata, step, vllm_config)
    assert host_prefill.kernel_calls() == calls + 2
    n = step.num_actual_tokens
    torch.testing.assert_close(out[:n].double(), reference(step), **BF16_TOL)
    host_prefill.reset_for_tests()


def test_host_rows_rule():
    """The cpu target's prefill routing on its own: short chunks join the decode
    kernel's rows. Against PyTorch's flash kernel longer ones move at 256 rows
    whatever their context; against the plugin's prefill kernel from 16 rows, once
    the chunk's (row, key) pairs make up for packing the keys (192 rows without
    context, 16 after ~1150 tokens)."""
    from spyre_inference.attention.policy import HOST_ROWS_MAX_QUERY, host_rows_win

    assert host_rows_win(1) and host_rows_win(HOST_ROWS_MAX_QUERY - 1, 4000)
    assert not host_rows_win(HOST_ROWS_MAX_QUERY) and not host_rows_win(8192)
    assert host_rows_win(15, 4000, plugin_kernel=True)
    assert host_rows_win(128, 0, plugin_kernel=True)
    assert not host_rows_win(192, 0, plugin_kernel=True)
    assert host_rows_win(16, 1000, plugin_kernel=True)
    assert not host_rows_win(16, 1200, plugin_kernel=True)
    assert not host_rows_win(HOST_ROWS_MAX_QUERY, 0, plugin_kernel=True)


# ---- the builder's plan -------------------------------------------------------


def test_builder_pads_onto_buckets_and_skips_padding_requests(vllm_config, monkeypatch):
    reset_settings(monkeypatch, SPYRE_BATCHED_DECODE="0")
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
    assert seq.block_ids.shape == (8,)
    assert seq.block_ids[:5].tolist() == step.block_table[0, :5].tolist()
    assert set(seq.block_ids[5:].tolist()) == {NULL_BLOCK}
    prefill = metadata.seqs[1]
    assert prefill.q_index.tolist() == list(range(1, 41)) + [1] * 24
    mask = metadata.tile_masks(None)[1]
    assert mask.shape == (64, 64) and mask.dtype == torch.float32
    # Row 39 (the last real one) sees keys 0..39; padded rows see nothing.
    assert (mask[39, :40] == 0).all() and (mask[39, 40:] < -1e30).all()
    assert (mask[40:] < -1e30).all()


def test_builder_batches_decodes(vllm_config, monkeypatch):
    """Single-row sequences go to one decode batch on a (num-seqs, pages) bucket."""
    reset_settings(monkeypatch, SPYRE_BATCHED_DECODE=None)  # the default: on
    block_size = vllm_config.cache_config.block_size
    case = Case([300, 40, 129, 7, 65], [1, 40, 1, 7, 1], pad_tokens=0)
    step = prepare(case, block_size)
    builder = SpyreAttentionMetadataBuilder(
        step.spec, ["layer.0"], vllm_config, torch.device("cpu")
    )
    metadata = builder.build(0, step.common)
    # The two prefills keep their own kernels ...
    assert [s.query_len for s in metadata.seqs] == [40, 7]
    # ... the three decodes (query rows 0, 41, 49) share one batch of 4 (max_num_seqs 16:
    # buckets 4, 8, 16), padded to the longest one's page bucket (300 tokens: 5 -> 8).
    batch = metadata.decode
    assert batch is not None
    assert batch.rows == [0, 41, 49] and batch.seq_lens == [300, 129, 65]
    assert (batch.num_seqs_bucket, batch.kv_block_bucket) == (4, 8)
    assert batch.q_index.tolist() == [0, 41, 49, 0]
    assert batch.out_index.tolist() == [0, 41, 49]
    table = step.block_table
    assert batch.block_ids[0, :5].tolist() == table[0, :5].tolist()
    assert batch.block_ids[1, :3].tolist() == table[2, :3].tolist()
    # Past each sequence's pages (stale ids in the table) and the padding entry: null.
    assert set(batch.block_ids[1, 3:].tolist()) == {NULL_BLOCK}
    assert set(batch.block_ids[3].tolist()) == {NULL_BLOCK}
    mask = metadata.decode_mask(None)
    assert mask.shape == (4, 8 * block_size)
    assert (mask[1, :129] == 0).all() and (mask[1, 129:] < -1e30).all()
    assert (mask[3] < -1e30).all()
    windowed = metadata.decode_mask(10)
    assert (windowed[1, 119:129] == 0).all() and (windowed[1, :119] < -1e30).all()


def test_alibi_bias_tiles(vllm_config, monkeypatch):
    reset_settings(monkeypatch, SPYRE_BATCHED_DECODE=None)
    block_size = vllm_config.cache_config.block_size
    step = prepare(Case([70, 5], [1, 5], pad_tokens=0), block_size)
    builder = SpyreAttentionMetadataBuilder(
        step.spec, ["layer.0"], vllm_config, torch.device("cpu")
    )
    metadata = builder.build(0, step.common)
    # Prefill of 5 with no context: row i, key j -> j - i.
    (bias,) = metadata.alibi_biases()
    assert bias[2, :5].tolist() == [-2.0, -1.0, 0.0, 1.0, 2.0]
    # The decode of a 70-token sequence sits at position 69.
    assert metadata.decode_alibi_bias()[0, 69].item() == 0.0
    assert metadata.decode_alibi_bias()[0, 0].item() == -69.0
