"""Head-major specifics: per-head store, folded views, start-up errors, compile policy.

The numerical matrix against dense SDPA runs in ``test_decoder_backends.py``.
"""

from __future__ import annotations

import dataclasses
import importlib

import pytest
import torch
import torch.nn.functional as F
from attn_testutil import (
    FP32_TOL,
    Case,
    allocate_layer_cache,
    make_impl,
    prepare,
    reference,
    reset_settings,
)
from vllm.config import set_current_vllm_config
from vllm.v1.attention.backends.registry import AttentionBackendEnum
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheLayout

from spyre_inference.attention.backends.head_major import (
    HeadMajorConfigError,
    SpyreHeadMajorAttentionBackend,
    SpyreHeadMajorAttentionImpl,
    SpyreHeadMajorMetadataBuilder,
    head_store_index,
)
from spyre_inference.attention.backends.paged import NULL_BLOCK
from spyre_inference.attention.backends.token_major import SpyreAttentionBackend
from spyre_inference.attention.ops import head_major_pages, head_major_rows
from spyre_inference.platform import discovery

BACKEND = SpyreHeadMajorAttentionBackend


def test_declarations_and_entry_point():
    assert AttentionBackendEnum[BACKEND.get_name()] is AttentionBackendEnum.CUSTOM
    assert BACKEND.supported_kv_cache_layouts() == (KVCacheLayout.LBHNC,)
    assert BACKEND.forward_includes_kv_cache_update is True
    assert BACKEND.get_impl_cls() is SpyreHeadMajorAttentionImpl
    assert BACKEND.get_builder_cls() is SpyreHeadMajorMetadataBuilder
    qualname = discovery.resolve_qualname(
        discovery.ATTENTION_BACKENDS_GROUP, "head_major", "the attention backend"
    )
    module, _, name = qualname.rpartition(".")
    assert getattr(importlib.import_module(module), name) is BACKEND


def test_folded_views_are_views_of_vllm_allocation():
    spec = FullAttentionSpec(block_size=64, num_kv_heads=2, head_size=16, dtype=torch.float32)
    cache = allocate_layer_cache(BACKEND, spec, 4)
    pages = head_major_pages(cache)
    assert pages.shape == (4 * 2, 64, 32) and pages.data_ptr() == cache.data_ptr()
    rows = head_major_rows(cache)
    assert rows.shape == (4 * 2 * 64, 32)
    # Row (block 3, head 1, token 5).
    rows[(3 * 2 + 1) * 64 + 5] = 7.0
    assert torch.equal(cache[3, 1, 5], torch.full((32,), 7.0))
    own = BACKEND.allocate_pages(spec, 4, "cpu")
    assert own.shape == cache.shape and own.stride() == cache.stride()


def test_folded_view_rejects_token_major_cache():
    spec = FullAttentionSpec(block_size=64, num_kv_heads=2, head_size=16, dtype=torch.float32)
    token_major = allocate_layer_cache(SpyreAttentionBackend, spec, 4)
    with pytest.raises(ValueError, match="LBHNC"):
        head_major_pages(token_major)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_store_puts_each_head_at_its_page(vllm_config, dtype):
    block_size = vllm_config.cache_config.block_size
    case = Case([300, 40, 129, 7, 65], [1, 40, 1, 7, 1], dtype=dtype, pad_tokens=5)
    step = prepare(BACKEND, case, block_size)
    before = step.kv_cache.clone()
    impl = make_impl(BACKEND, vllm_config, case)
    impl.do_kv_cache_update(None, step.key, step.value, step.kv_cache, step.common.slot_mapping)
    D = case.head_size
    expected = before.clone()
    for t, slot in enumerate(step.common.slot_mapping[: step.num_actual_tokens].tolist()):
        blk, off = divmod(slot, block_size)
        for h in range(case.num_kv_heads):
            assert torch.equal(step.kv_cache[blk, h, off, :D], step.key[t, h])
            assert torch.equal(step.kv_cache[blk, h, off, D:], step.value[t, h])
        expected[blk, :, off, :D] = step.key[t]
        expected[blk, :, off, D:] = step.value[t]
    # Padding tokens went to slot 0 of the null block; nothing else changed.
    assert torch.equal(step.kv_cache[NULL_BLOCK + 1 :], expected[NULL_BLOCK + 1 :])
    assert torch.equal(step.kv_cache[NULL_BLOCK, :, 1:], before[NULL_BLOCK, :, 1:])


def test_head_store_index_matches_definition():
    slots = torch.tensor([0, 5, 64 + 3, 3 * 64 + 63])
    index = head_store_index(slots, num_kv_heads=2, block_size=64)
    for t, slot in enumerate(slots.tolist()):
        blk, off = divmod(slot, 64)
        for h in range(2):
            assert index[h, t] == (blk * 2 + h) * 64 + off


def test_page_index_of_builder(vllm_config):
    block_size = vllm_config.cache_config.block_size
    step = prepare(BACKEND, Case([130], [10], pad_tokens=0), block_size)
    builder = SpyreHeadMajorMetadataBuilder(step.spec, ["l"], vllm_config, torch.device("cpu"))
    (seq,) = builder.build(0, step.common).seqs
    table = step.block_table[0, :3].tolist()
    assert seq.page_index.shape == (2, 4)  # 3 pages -> bucket 4
    assert seq.page_index[:, :3].tolist() == [[b * 2 + h for b in table] for h in range(2)]
    assert seq.page_index[:, 3].tolist() == [NULL_BLOCK * 2, NULL_BLOCK * 2 + 1]


# ---- compile policy and start-up errors ------------------------------------------


def test_always_compiles_attention_even_under_enforce_eager(vllm_config, compiled_vllm_config):
    eager = make_impl(BACKEND, vllm_config, Case([1], [1]))
    assert vllm_config.model_config.enforce_eager
    assert eager.compile_kernels is True
    # The store follows the model: its token count is only bucketed when it compiles.
    assert eager.compile_store is False
    assert make_impl(BACKEND, compiled_vllm_config, Case([1], [1])).compile_store is True
    # The token-major backend stays eager under --enforce-eager.
    assert make_impl(SpyreAttentionBackend, vllm_config, Case([1], [1])).compile_kernels is False


def test_alibi_rejected_at_construction(vllm_config):
    with (
        set_current_vllm_config(vllm_config),
        pytest.raises(NotImplementedError, match="SPYRE_ATTN_KV_LAYOUT=token_major"),
    ):
        SpyreHeadMajorAttentionImpl(4, 16, 0.25, 2, alibi_slopes=[0.5, 0.25, 0.125, 0.0625])


def test_explicit_batched_decode_rejected(vllm_config, monkeypatch):
    reset_settings(monkeypatch, SPYRE_BATCHED_DECODE="1")
    with pytest.raises(HeadMajorConfigError, match="SPYRE_BATCHED_DECODE"):
        BACKEND.validate_config(vllm_config)
    with pytest.raises(HeadMajorConfigError, match="token-major pages"):
        make_impl(BACKEND, vllm_config, Case([1], [1]))


def test_default_batched_decode_is_not_used(vllm_config, monkeypatch):
    reset_settings(monkeypatch, SPYRE_BATCHED_DECODE=None)
    BACKEND.validate_config(vllm_config)  # the default is not a request
    block_size = vllm_config.cache_config.block_size
    step = prepare(BACKEND, Case([100, 70], [1, 1]), block_size)
    builder = SpyreHeadMajorMetadataBuilder(step.spec, ["l"], vllm_config, torch.device("cpu"))
    metadata = builder.build(0, step.common)
    assert metadata.decode is None and len(metadata.seqs) == 2
    reset_settings(monkeypatch, SPYRE_BATCHED_DECODE="0")
    BACKEND.validate_config(vllm_config)


# ---- steps in a row, and through vLLM's Attention layer ---------------------------


def test_decode_steps_accumulate_in_cache(vllm_config):
    """Three decode steps (compiled kernels): each step's token is read back by the next."""
    block_size = vllm_config.cache_config.block_size
    case = Case([63], [1], pad_tokens=0)
    step = prepare(BACKEND, case, block_size)
    impl = make_impl(BACKEND, vllm_config, case)
    builder = SpyreHeadMajorMetadataBuilder(step.spec, ["l"], vllm_config, torch.device("cpu"))
    gen = torch.Generator().manual_seed(7)
    k_all, v_all = step.k_full[0], step.v_full[0]
    table = step.block_table[0]
    table[1] = next(b for b in range(1, 5) if b != int(table[0]))
    for seq_len in (63, 64, 65):
        q = torch.randn(1, 4, 16, generator=gen)
        if seq_len > 63:
            k_new, v_new = (
                torch.randn(1, 2, 16, generator=gen),
                torch.randn(1, 2, 16, generator=gen),
            )
            k_all, v_all = torch.cat([k_all, k_new]), torch.cat([v_all, v_new])
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
        out = impl.forward(None, q, k_new, v_new, step.kv_cache, metadata, torch.empty_like(q))
        ref = F.scaled_dot_product_attention(
            q.transpose(0, 1).double(),
            k_all.repeat_interleave(2, dim=1).transpose(0, 1).double(),
            v_all.repeat_interleave(2, dim=1).transpose(0, 1).double(),
            scale=16**-0.5,
        ).transpose(0, 1)
        torch.testing.assert_close(out.double(), ref, **FP32_TOL)


def test_through_vllm_attention_layer(vllm_config):
    from vllm.forward_context import set_forward_context
    from vllm.model_executor.layers.attention import Attention

    # A layer name of its own: the session's config keeps every registered layer.
    name = "model.layers.7.self_attn.attn"
    case = Case([300, 40, 129, 7, 65], [1, 40, 1, 7, 1], sliding_window=40)
    with set_current_vllm_config(vllm_config):
        layer = Attention(
            num_heads=4,
            head_size=16,
            scale=16**-0.5,
            num_kv_heads=2,
            per_layer_sliding_window=40,
            cache_config=vllm_config.cache_config,
            prefix=name,
            attn_backend=BACKEND,
        )
    assert isinstance(layer.impl, SpyreHeadMajorAttentionImpl)
    step = prepare(BACKEND, case, vllm_config.cache_config.block_size)
    layer.bind_kv_cache(step.kv_cache)
    builder = SpyreHeadMajorMetadataBuilder(step.spec, [name], vllm_config, torch.device("cpu"))
    metadata = builder.build(0, step.common)
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
    out = out.view(tokens, 4, 16)
    torch.testing.assert_close(out[:n].double(), reference(step), **FP32_TOL)
