"""The encoder backend against plain PyTorch attention (bidirectional SDPA, float64).

Each sequence of a step attends to all of its own tokens (and, with a window,
to those within ``W`` positions either way). The backend packs the ragged step
into a dense padded batch, so the cases mix lengths that do and do not fill a
64-token bucket, a single unpadded sequence (the fused SDPA path), MiniLM's
head size 32 (padded to the 64-element stick), GQA/MQA and windows.

Tolerances: float32 within 5e-6 abs / 1e-5 rel; bfloat16 within 3e-2.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from attn_testutil import BF16_TOL, FP32_TOL
from vllm.config import set_current_vllm_config
from vllm.v1.attention.backend import AttentionType, CommonAttentionMetadata
from vllm.v1.kv_cache_interface import EncoderOnlyAttentionSpec

from spyre_inference.attention import ops
from spyre_inference.attention.backends.encoder import (
    SpyreEncoderAttentionBackend,
    SpyreEncoderAttentionImpl,
    SpyreEncoderMetadataBuilder,
)
from spyre_inference.platform import discovery

BACKEND = SpyreEncoderAttentionBackend


def common(seq_lens: list[int], pad: int) -> CommonAttentionMetadata:
    qsl = torch.zeros(len(seq_lens) + 1, dtype=torch.int32)
    qsl[1:] = torch.tensor(seq_lens).cumsum(0)
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    n = sum(seq_lens)
    return CommonAttentionMetadata(
        query_start_loc=qsl,
        query_start_loc_cpu=qsl.clone(),
        seq_lens=lens,
        seq_lens_cpu_upper_bound=lens.clone(),
        num_reqs=len(seq_lens),
        num_actual_tokens=n,
        max_query_len=max(seq_lens),
        max_seq_len=max(seq_lens),
        block_table_tensor=torch.zeros((len(seq_lens), 1), dtype=torch.int32),
        slot_mapping=torch.full((n + pad,), -1, dtype=torch.int64),
        causal=False,
    )


def reference(q, k, v, seq_lens, scale, window):
    groups = q.shape[1] // k.shape[1]
    outs, start = [], 0
    for n in seq_lens:
        qs = q[start : start + n].double().transpose(0, 1)
        ks = k[start : start + n].double().repeat_interleave(groups, 1).transpose(0, 1)
        vs = v[start : start + n].double().repeat_interleave(groups, 1).transpose(0, 1)
        mask = None
        if window is not None:
            pos = torch.arange(n)
            mask = (pos.view(-1, 1) - pos.view(1, -1)).abs() < window
        outs.append(F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask, scale=scale))
        start += n
    return torch.cat([o.transpose(0, 1) for o in outs])


def run(
    vllm_config,
    seq_lens,
    *,
    heads=4,
    kv_heads=4,
    head_size=64,
    dtype=torch.float32,
    window=None,
    compile_kernels=None,
    pad=3,
):
    gen = torch.Generator().manual_seed(0)
    n = sum(seq_lens)
    q = torch.randn(n + pad, heads, head_size, generator=gen).to(dtype)
    k = torch.randn(n + pad, kv_heads, head_size, generator=gen).to(dtype)
    v = torch.randn(n + pad, kv_heads, head_size, generator=gen).to(dtype)
    spec = EncoderOnlyAttentionSpec(
        block_size=64, num_kv_heads=kv_heads, head_size=head_size, dtype=dtype
    )
    builder = SpyreEncoderMetadataBuilder(spec, ["enc"], vllm_config, torch.device("cpu"))
    metadata = builder.build(0, common(seq_lens, pad))
    scale = head_size**-0.5
    with set_current_vllm_config(vllm_config):
        impl = SpyreEncoderAttentionImpl(
            heads,
            head_size,
            scale,
            kv_heads,
            sliding_window=window,
            attn_type=AttentionType.ENCODER_ONLY,
        )
    if compile_kernels is not None:
        assert impl.compile_kernels == compile_kernels
    out = impl.forward(None, q, k, v, None, metadata, output=torch.full_like(q, float("nan")))
    ref = reference(q[:n], k[:n], v[:n], seq_lens, scale, window)
    tol = FP32_TOL if dtype == torch.float32 else BF16_TOL
    torch.testing.assert_close(out[:n].double(), ref, **tol)
    assert torch.equal(out[n:], torch.zeros_like(out[n:]))
    return metadata


CASES = {
    "single_unpadded_fused": [64],
    "single_padded": [50],
    "ragged_batch": [5, 64, 17, 100],
    "long_and_short": [200, 1, 3],
}


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_matches_sdpa(vllm_config, case, dtype):
    md = run(vllm_config, CASES[case], dtype=dtype, compile_kernels=False)
    assert md.unpadded == (case == "single_unpadded_fused")


@pytest.mark.parametrize("case", ["single_unpadded_fused", "ragged_batch"])
def test_minilm_head_size_32(vllm_config, case):
    """12 heads of 32 (all-MiniLM-L6-v2): the head dim is padded to one stick."""
    run(vllm_config, CASES[case], heads=12, kv_heads=12, head_size=32)


@pytest.mark.parametrize(("heads", "kv_heads"), [(8, 2), (8, 1)], ids=["gqa4", "mqa"])
def test_grouped_heads(vllm_config, heads, kv_heads):
    run(vllm_config, CASES["ragged_batch"], heads=heads, kv_heads=kv_heads)


@pytest.mark.parametrize("window", [1, 16, 70])
def test_bidirectional_sliding_window(vllm_config, window):
    run(vllm_config, [64, 100, 9], window=window)


def test_buckets_and_pack_index(vllm_config):
    md = run(vllm_config, [5, 64, 17])
    # max_num_seqs 16 -> 1, 2, 4, ...; longest 64 -> 64 (buckets 64, 128, 256, ...).
    assert (md.num_seqs_bucket, md.seq_len_bucket) == (4, 64)
    assert md.pack_index.tolist() == [*range(5), *range(64, 128), *range(128, 145)]


def test_compiled_matches_sdpa(compiled_vllm_config):
    """Compiled QK and P.V graphs (padded path) and the compiled fused path."""
    run(compiled_vllm_config, CASES["ragged_batch"], compile_kernels=True)
    run(compiled_vllm_config, [128], heads=12, kv_heads=12, head_size=32, compile_kernels=True)
    # Both paths went through Inductor graphs (kept per variant by the families).
    assert len(ops.ENCODER_SCORES) > 0 and len(ops.ENCODER_PROBS_V) > 0
    assert len(ops.ENCODER_FUSED) > 0


def test_declarations_and_entry_point():
    assert BACKEND.supports_attn_type(AttentionType.ENCODER_ONLY)
    assert BACKEND.supports_attn_type(AttentionType.ENCODER)
    assert not BACKEND.supports_attn_type(AttentionType.DECODER)
    assert BACKEND.supports_head_size(32) and BACKEND.supports_head_size(384)
    assert BACKEND.supported_kv_cache_layouts() is None
    qualname = discovery.resolve_qualname(
        discovery.ATTENTION_BACKENDS_GROUP, "encoder", "the attention backend"
    )
    assert qualname.endswith("SpyreEncoderAttentionBackend")


def test_through_vllm_encoder_only_attention(vllm_config):
    """vLLM's EncoderOnlyAttention picks the backend through the platform and runs it."""
    from vllm.forward_context import set_forward_context
    from vllm.model_executor.layers.attention.encoder_only_attention import (
        EncoderOnlyAttention,
    )

    name = "bert.encoder.layer.0.attention.self.attn"
    heads, head_size = 12, 32
    with set_current_vllm_config(vllm_config):
        layer = EncoderOnlyAttention(
            num_heads=heads,
            head_size=head_size,
            scale=head_size**-0.5,
            cache_config=vllm_config.cache_config,
            prefix=name,
        )
    assert isinstance(layer.impl, SpyreEncoderAttentionImpl)
    assert issubclass(layer.attn_backend, SpyreEncoderAttentionBackend)
    seq_lens = [7, 30, 64]
    n = sum(seq_lens)
    gen = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(n + 2, heads * head_size, generator=gen) for _ in range(3))
    spec = EncoderOnlyAttentionSpec(
        block_size=64, num_kv_heads=heads, head_size=head_size, dtype=torch.float32
    )
    builder = layer.attn_backend.get_builder_cls()(spec, [name], vllm_config, torch.device("cpu"))
    cm = common(seq_lens, 2)
    cm.causal = True  # vLLM's encoder-only builder wrapper turns it off
    metadata = builder.build(0, cm)
    with set_forward_context({name: metadata}, vllm_config, slot_mapping={}):
        out = layer(q, k, v)
    ref = reference(
        q[:n].view(n, heads, head_size),
        k[:n].view(n, heads, head_size),
        v[:n].view(n, heads, head_size),
        seq_lens,
        head_size**-0.5,
        None,
    )
    torch.testing.assert_close(out[:n].view(n, heads, head_size).double(), ref, **FP32_TOL)
