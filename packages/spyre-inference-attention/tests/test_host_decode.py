"""The cpu target's decode-attention kernel (``ops.host_decode``).

Reference: a plain PyTorch softmax attention in float64 over the same pages,
gathered with ``index_select`` and masked with the same additive mask (written
here, not the plugin's kernels). The kernel computes in float32 from the
cache's values, so the bound is float32 rounding: ``1e-5`` relative to the
largest value of V. The compiled batched-decode graph (the card's kernel) must
agree with the kernel to the same bound, and the backend tests
(``test_decoder_backends.py``) run whole steps through both.
"""

from __future__ import annotations

import pytest
import torch

from spyre_inference.attention import ops, policy
from spyre_inference.attention.ops import host_decode

pytestmark = pytest.mark.skipif(
    host_decode.unavailable_reason(torch.bfloat16, 64, 4, 2) is not None,
    reason=f"kernel unavailable: {host_decode.unavailable_reason(torch.bfloat16, 64, 4, 2)}",
)

MASKED = ops.mask_value(torch.float32)


def _pages(num_blocks, block_size, kv_heads, head, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(num_blocks, block_size, kv_heads, 2 * head, generator=gen).to(dtype)


def _case(num_seqs, kv_blocks, block_size, num_blocks, seq_lens, window=None, seed=1):
    gen = torch.Generator().manual_seed(seed)
    block_ids = torch.randint(1, num_blocks, (num_seqs, kv_blocks), generator=gen)
    keys = torch.arange(kv_blocks * block_size)[None]
    lens = torch.tensor(seq_lens)[:, None]
    keep = keys < lens
    if window is not None:
        keep &= (lens - 1 - keys) < window
    mask = torch.zeros(num_seqs, kv_blocks * block_size).masked_fill_(~keep, MASKED)
    return block_ids, mask


def _reference(q, pages, block_ids, mask, scale, sinks=None):
    num_seqs, num_heads, head = q.shape
    kv_heads = pages.shape[2]
    groups = num_heads // kv_heads
    kv = pages.index_select(0, block_ids.reshape(-1)).double()
    kv = kv.view(num_seqs, -1, kv_heads, 2 * head)
    k, v = kv[..., :head], kv[..., head:]
    qd = q.double().view(num_seqs, kv_heads, groups, head)
    scores = torch.einsum("skgd,stkd->skgt", qd, k) * scale + mask.double()[:, None, None, :]
    if sinks is not None:
        # softmax over [scores, sink] per head, the sink column dropped.
        sink = sinks.double().view(1, kv_heads, groups, 1).expand(num_seqs, -1, -1, 1)
        probs = torch.softmax(torch.cat((scores, sink), dim=-1), dim=-1)[..., :-1]
    else:
        probs = torch.softmax(scores, dim=-1)
    return torch.einsum("skgt,stkd->skgd", probs, v).reshape(num_seqs, num_heads, head)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize(
    ("num_heads", "kv_heads", "head"),
    [(4, 4, 64), (9, 3, 64), (8, 1, 128), (4, 2, 8)],
    ids=["mha", "gqa3_smollm2", "mqa_d128", "d8"],
)
@pytest.mark.parametrize(
    ("seq_lens", "kv_blocks", "window"),
    [([1], 1, None), ([100, 17, 64, 1], 2, None), ([300, 129, 5], 5, None), ([300, 90], 5, 40)],
    ids=["one_token", "batch4_partial_pages", "multi_page", "sliding_window"],
)
def test_matches_float64_reference(dtype, num_heads, kv_heads, head, seq_lens, kv_blocks, window):
    block_size = 64
    pages = _pages(40, block_size, kv_heads, head, dtype)
    block_ids, mask = _case(len(seq_lens), kv_blocks, block_size, 40, seq_lens, window)
    q = torch.randn(len(seq_lens), num_heads, head).to(dtype)
    scale = head**-0.5
    got = host_decode.paged_decode(q, pages, block_ids, mask, scale)
    want = _reference(q, pages, block_ids, mask, scale)
    assert got.dtype == torch.float32 and got.shape == want.shape
    bound = 1e-5 * pages[..., head:].abs().max().item()
    assert (got.double() - want).abs().max().item() <= bound


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("sink_gain", [2.0, 30.0], ids=["sinks", "dominant_sinks"])
def test_attention_sinks_match_float64_reference(dtype, sink_gain):
    """Sinks (gpt-oss), including ones far above every score (the maximum is the
    sink's, and the keys' share underflows gracefully), with a sliding window."""
    block_size, num_heads, kv_heads, head = 64, 8, 2, 64
    pages = _pages(40, block_size, kv_heads, head, dtype)
    block_ids, mask = _case(3, 5, block_size, 40, [300, 90, 1], window=40)
    q = torch.randn(3, num_heads, head).to(dtype)
    sinks = torch.randn(num_heads, generator=torch.Generator().manual_seed(3)) * sink_gain
    scale = head**-0.5
    got = host_decode.paged_decode(q, pages, block_ids, mask, scale, sinks=sinks)
    want = _reference(q, pages, block_ids, mask, scale, sinks)
    plain = _reference(q, pages, block_ids, mask, scale)
    bound = 1e-5 * pages[..., head:].abs().max().item()
    assert (got.double() - want).abs().max().item() <= bound
    assert (want - plain).abs().max().item() > 100 * bound  # the sinks matter here
    with pytest.raises(ValueError, match="sinks"):
        host_decode.paged_decode(q, pages, block_ids, mask, scale, sinks=sinks[:4])


def test_padding_sequences_get_zeros_and_the_rest_is_unaffected():
    pages = _pages(10, 16, 2, 64, torch.bfloat16)
    block_ids, mask = _case(4, 2, 16, 10, [20, 0, 7, 0])
    q = torch.randn(4, 4, 64).to(torch.bfloat16)
    got = host_decode.paged_decode(q, pages, block_ids, mask, 0.125)
    assert (got[[1, 3]] == 0).all()
    alone = host_decode.paged_decode(q[:1], pages, block_ids[:1], mask[:1], 0.125)
    assert torch.equal(got[:1], alone)  # per-sequence result, whatever the batch


def test_strided_pages_of_a_multi_layer_cache():
    """A layer's pages are a view into a cache shared by layers (LBNHC): strided blocks."""
    cache = _pages(2 * 12, 16, 2, 64, torch.bfloat16).view(12, 2, 16, 2, 128)
    layer = cache[:, 1]  # [blocks, block_size, kv_heads, 2 * head], block stride 2x
    assert not layer.is_contiguous()
    block_ids, mask = _case(3, 2, 16, 12, [30, 16, 3])
    q = torch.randn(3, 4, 64).to(torch.bfloat16)
    got = host_decode.paged_decode(q, layer, block_ids, mask, 0.125)
    want = host_decode.paged_decode(q, layer.contiguous(), block_ids, mask, 0.125)
    assert torch.equal(got, want)
    assert (got.double() - _reference(q, layer, block_ids, mask, 0.125)).abs().max() < 1e-4


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_agrees_with_the_compiled_graph(dtype, monkeypatch):
    """The card's batched-decode graph on the same inputs (cpu flash form)."""
    pages = _pages(30, 64, 3, 64, dtype)
    block_ids, mask = _case(4, 4, 64, 30, [200, 64, 1, 0])
    q = torch.randn(4, 9, 64).to(dtype)
    got = host_decode.paged_decode(q, pages, block_ids, mask, 0.125)
    flash = policy.use_flash(None, dtype)
    graph = ops.BATCHED_DECODE(True, q, pages, block_ids, mask, 0.125, None, 4, None, None, flash)
    real = slice(0, 3)  # the padding entry's output is never written back
    bound = 1e-5 * pages[..., 64:].float().abs().max().item()
    assert (got[real] - graph[real].float()).abs().max().item() <= bound + (
        0 if dtype == torch.float32 else 2**-8 * got[real].abs().max().item()
    )


def test_bad_arguments():
    pages = _pages(4, 16, 2, 64, torch.bfloat16)
    block_ids, mask = _case(1, 1, 16, 4, [5])
    q = torch.randn(1, 4, 64).to(torch.bfloat16)
    with pytest.raises(ValueError, match=r"not token-major K\|V rows"):
        host_decode.paged_decode(q, pages[..., :64], block_ids, mask, 0.125)
    with pytest.raises(ValueError, match="disagree"):
        host_decode.paged_decode(q, pages, block_ids, mask[:, :8], 0.125)
    assert "not a multiple of 8" in host_decode.unavailable_reason(torch.bfloat16, 60, 4, 2)
    assert "KV cache dtype" in host_decode.unavailable_reason(torch.int8, 64, 4, 2)


def test_policy(monkeypatch):
    from spyre_inference.platform import settings

    args = (torch.bfloat16, 64, 4, 2)
    assert policy.use_host_decode(None, False, *args)
    assert not policy.use_host_decode(30.0, False, *args)  # soft-cap: the graph
    assert not policy.use_host_decode(None, True, *args)  # ALiBi: the graph
    monkeypatch.setenv("SPYRE_CPU_ATTN_KERNEL", "graph")
    settings.reset_cache()
    try:
        assert not policy.use_host_decode(None, False, *args)
    finally:
        monkeypatch.delenv("SPYRE_CPU_ATTN_KERNEL")
        settings.reset_cache()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("padding_rows", [0, 3])
def test_store_and_decode_is_the_store_then_the_kernel(dtype, padding_rows):
    """The fused call = ``index_copy_`` of K|V at the slots, then attention, then
    the result rounded to the output dtype by torch, padding rows zeroed.

    K and V are strided views into one fused QKV buffer, as the model hands
    them over; the reference store is torch's own ``index_copy_``.
    """
    block_size, num_blocks, heads, kv_heads, head = 64, 12, 9, 3, 64
    seq_lens = [70, 1, 129]
    num_seqs = len(seq_lens)
    tokens = num_seqs + padding_rows
    gen = torch.Generator().manual_seed(3)
    pages = _pages(num_blocks, block_size, kv_heads, head, dtype)
    _, mask = _case(num_seqs, 3, block_size, num_blocks, seq_lens)
    # Distinct pages per sequence, so no two new tokens share a slot.
    block_ids = torch.tensor([[3, 7, 1], [5, 2, 9], [11, 4, 8]])
    # Each sequence's new token sits at position seq_len - 1 of its own pages;
    # padding tokens go to slots of the null block 0.
    slots = torch.tensor(
        [
            int(block_ids[i, (n - 1) // block_size]) * block_size + (n - 1) % block_size
            for i, n in enumerate(seq_lens)
        ]
        + list(range(padding_rows)),
        dtype=torch.int64,
    )
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head, generator=gen).to(dtype)
    q = qkv[:, : heads * head].view(tokens, heads, head)
    k = qkv[:, heads * head : (heads + kv_heads) * head].view(tokens, kv_heads, head)
    v = qkv[:, (heads + kv_heads) * head :].view(tokens, kv_heads, head)

    want_pages = pages.clone()
    want_pages.view(-1, kv_heads, 2 * head).index_copy_(0, slots, torch.cat((k, v), dim=-1))
    want = host_decode.paged_decode(q[:num_seqs], want_pages, block_ids, mask, 0.125)

    out = torch.full((tokens, heads, head), float("nan"), dtype=dtype)
    host_decode.store_and_decode(q[:num_seqs], k, v, slots, pages, block_ids, mask, 0.125, out)
    assert torch.equal(pages, want_pages)
    assert torch.equal(out[:num_seqs], want.to(dtype))
    assert not out[num_seqs:].any()
    # And against the float64 reference, through the stored pages.
    ref = _reference(q[:num_seqs], want_pages, block_ids, mask, 0.125)
    torch.testing.assert_close(out[:num_seqs].double(), ref, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("sinks", [False, True], ids=["plain", "sinks"])
def test_the_cpp_call_and_the_python_call_agree(monkeypatch, sinks):
    """The C++ operator (``csrc/decode_dispatch.cpp``) and the Python checks with the
    ctypes call it replaces where no C++ toolchain exists: bit-equal stores and
    results, the same argument errors (ValueError, same words)."""
    if host_decode._native_call() is None:
        pytest.skip("the C++ call cannot be built here")
    block_size, kv_heads, heads, head = 64, 3, 9, 64
    gen = torch.Generator().manual_seed(7)
    block_ids, mask = _case(3, 3, block_size, 12, [70, 1, 129])
    qkv = torch.randn(5, (heads + 2 * kv_heads) * head, generator=gen).bfloat16()
    q = qkv[:3, : heads * head].view(3, heads, head)
    k = qkv[:, heads * head : (heads + kv_heads) * head].view(5, kv_heads, head)
    v = qkv[:, (heads + kv_heads) * head :].view(5, kv_heads, head)
    slots = torch.tensor([69, 64 * 4, 64 * 2 + 1, 0, 1])
    sk = torch.randn(heads) if sinks else None
    results = []
    for native in (True, False):
        if not native:
            monkeypatch.setattr(host_decode, "_native_call", lambda: None)
        pages = _pages(12, block_size, kv_heads, head, torch.bfloat16)
        out = torch.full((5, heads, head), float("nan"), dtype=torch.bfloat16)
        host_decode.store_and_decode(q, k, v, slots, pages, block_ids, mask, 0.125, out, sk)
        results.append((pages, out))
        with pytest.raises(ValueError, match="disagree"):
            host_decode.paged_decode(q, pages, block_ids, mask[:, :8], 0.125)
        with pytest.raises(ValueError, match="does not fit pages"):
            host_decode.store_and_decode(q, k.float(), v, slots, pages, block_ids, mask, 0.1, out)
    (pages_c, out_c), (pages_py, out_py) = results
    assert torch.equal(pages_c, pages_py)
    assert torch.equal(out_c, out_py)


def test_store_and_decode_without_a_store_only_attends():
    """A layer sharing another layer's cache stores nothing (key None)."""
    pages = _pages(8, 64, 2, 64, torch.bfloat16)
    block_ids, mask = _case(2, 2, 64, 8, [100, 3])
    q = torch.randn(2, 4, 64).to(torch.bfloat16)
    before = pages.clone()
    out = torch.empty(2, 4, 64, dtype=torch.bfloat16)
    host_decode.store_and_decode(q, None, None, None, pages, block_ids, mask, 0.125, out)
    assert torch.equal(pages, before)
    want = host_decode.paged_decode(q, pages, block_ids, mask, 0.125, out_dtype=torch.bfloat16)
    assert torch.equal(out, want)


def test_store_and_decode_refuses_keys_of_another_dtype():
    pages = _pages(8, 64, 2, 64, torch.bfloat16)
    block_ids, mask = _case(1, 1, 64, 8, [3])
    q = torch.randn(1, 4, 64).to(torch.bfloat16)
    k = torch.randn(1, 2, 64)  # float32 keys, bfloat16 cache
    with pytest.raises(ValueError, match="does not fit pages"):
        host_decode.store_and_decode(
            q, k, k, torch.tensor([5]), pages, block_ids, mask, 0.125, torch.empty(1, 4, 64)
        )


@pytest.fixture
def restore_isa():
    yield
    from spyre_inference.platform import device as dev

    dev.reset_for_tests()
    host_decode.reset_for_tests()


@pytest.mark.parametrize("isa", ["avx2", "avx512"])
def test_each_isa_build_matches_float64(monkeypatch, restore_isa, isa):
    """SPYRE_CPU_ISA forces a build of the kernel: it is the one loaded, within float32
    rounding of the float64 reference on every head layout (G of 1 to 8 heads, so the
    AVX-512 build's score passes of up to 4 heads split evenly and unevenly; head
    sizes 8 to 128, one that is not a multiple of 16), with sinks, in every dtype."""
    from spyre_inference.platform import device as dev
    from spyre_inference.platform.native_build import AVX512_CPU_FLAGS, cpu_flags

    if isa == "avx512" and not set(AVX512_CPU_FLAGS) <= cpu_flags():
        pytest.skip("this CPU has no AVX-512 F/BW/VL/DQ")
    monkeypatch.setenv("SPYRE_CPU_ISA", isa)
    dev.reset_for_tests()
    host_decode.reset_for_tests()
    assert host_decode.kernel_isa() == isa
    block_size = 64
    for num_heads, kv_heads, head in (
        (4, 4, 64),
        (9, 3, 64),
        (8, 1, 128),
        (4, 2, 8),
        (12, 2, 24),
        (14, 2, 64),
        (5, 1, 32),
    ):
        for dtype in (torch.float32, torch.bfloat16, torch.float16):
            pages = _pages(40, block_size, kv_heads, head, dtype, seed=head)
            block_ids, mask = _case(4, 5, block_size, 40, [300, 1, 129, 64])
            q = torch.randn(4, num_heads, head).to(dtype)
            sinks = torch.randn(num_heads)
            got = host_decode.paged_decode(q, pages, block_ids, mask, head**-0.5, sinks=sinks)
            want = _reference(q, pages, block_ids, mask, head**-0.5, sinks)
            vmax = pages[..., head:].abs().max().double()
            torch.testing.assert_close(got.double(), want, atol=1e-5 * vmax, rtol=0)


@pytest.mark.parametrize("isa", ["avx2", "avx512"])
def test_a_sequence_gets_the_same_bits_alone_and_in_a_batch(monkeypatch, restore_isa, isa):
    """A sequence's output does not depend on the batch around it, to the bit: the
    threads share (sequence, KV head) items however many there are, and nothing of
    one item's arithmetic depends on another (greedy decoding gives a request the
    same tokens alone and in any batch)."""
    from spyre_inference.platform import device as dev
    from spyre_inference.platform.native_build import AVX512_CPU_FLAGS, cpu_flags

    if isa == "avx512" and not set(AVX512_CPU_FLAGS) <= cpu_flags():
        pytest.skip("this CPU has no AVX-512 F/BW/VL/DQ")
    monkeypatch.setenv("SPYRE_CPU_ISA", isa)
    dev.reset_for_tests()
    host_decode.reset_for_tests()
    block_size = 64
    seq_lens = [300, 1, 129, 64, 77, 3, 256, 190]
    layouts = ((9, 3, 64), (12, 4, 64), (8, 2, 128), (14, 2, 64), (4, 4, 32))
    for num_heads, kv_heads, head in layouts:
        for dtype in (torch.float32, torch.bfloat16, torch.float16):
            pages = _pages(60, block_size, kv_heads, head, dtype, seed=head)
            block_ids, mask = _case(len(seq_lens), 5, block_size, 60, seq_lens)
            q = torch.randn(len(seq_lens), num_heads, head).to(dtype)
            sinks = torch.randn(num_heads)
            batch = host_decode.paged_decode(q, pages, block_ids, mask, head**-0.5, sinks=sinks)
            for s in range(len(seq_lens)):
                one = slice(s, s + 1)
                alone = host_decode.paged_decode(
                    q[one], pages, block_ids[one], mask[one], head**-0.5, sinks=sinks
                )
                assert torch.equal(alone[0], batch[s]), (num_heads, kv_heads, head, dtype, s)
