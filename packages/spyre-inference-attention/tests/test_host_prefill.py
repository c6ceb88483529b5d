"""The cpu target's prefill attention, each kernel forced, against float64 attention.

``ops.host_prefill.paged_prefill`` attends one sequence's chunk over its pages
through the plugin's AVX-512 BF16 kernel (``csrc/paged_prefill.c``) or
PyTorch's CPU flash kernel (``SPYRE_CPU_PREFILL_KERNEL``). Both are checked
here against plain float64 attention over the same pages (causal with the
chunk's offset, a sliding window, attention sinks), on the head layouts and
page sizes models bring, including a chunk after earlier context and pages
scattered through the cache. The kernel's tiles are 64 keys by 4 rows, so the
lengths straddle those edges.
"""

from __future__ import annotations

import pytest
import torch

from spyre_inference.attention import config_checks
from spyre_inference.attention.ops import host_prefill
from spyre_inference.platform import device, settings

#: bfloat16 in and out: the output's rounding (half an ulp of values up to ~4)
#: plus the probabilities' rounding to bf16 for P V, as PyTorch's kernel does.
BF16_ATOL = 2e-2

#: (query rows, context, heads, KV heads, head size, block size, window, sinks)
SHAPES = [
    (300, 0, 9, 3, 64, 64, None, False),  # SmolLM2's heads, a first chunk
    (257, 1000, 9, 3, 64, 64, None, False),  # a later chunk
    (256, 0, 8, 8, 128, 16, None, False),  # MHA, head 128, small pages
    (260, 37, 4, 1, 32, 16, None, False),  # MQA, head 32, context mid-page
    (270, 3, 6, 2, 48, 64, None, False),  # head 48: three 16-lane chunks
    (400, 100, 6, 2, 64, 64, 100, False),  # a window inside the chunk
    (300, 500, 8, 2, 64, 64, 4096, False),  # a window longer than the sequence
    (300, 0, 9, 3, 64, 64, None, True),  # sinks (gpt-oss)
    (300, 50, 12, 2, 256, 64, 77, True),  # head 256, window and sinks
    (1, 0, 3, 3, 64, 64, None, False),  # one row
]


@pytest.fixture
def prefill_kernel(monkeypatch):
    """Force ``SPYRE_CPU_PREFILL_KERNEL`` (a function of the test) and restore it after."""

    def force(choice: str) -> None:
        monkeypatch.setenv("SPYRE_CPU_PREFILL_KERNEL", choice)
        settings.reset_cache()
        host_prefill.reset_for_tests()

    yield force
    monkeypatch.undo()
    settings.reset_cache()
    device.reset_for_tests()
    host_prefill.reset_for_tests()


def _needs_kernel() -> None:
    reason = host_prefill.kernel_unavailable_reason()
    if reason is not None:
        pytest.skip(f"the prefill kernel cannot run here: {reason}")


def _case(q_len, context, num_heads, kv_heads, head, block_size, seed=0):
    """Pages with the sequence's blocks scattered among spare ones, and its block ids."""
    gen = torch.Generator().manual_seed(seed)
    seq_len = context + q_len
    num_pages = -(-seq_len // block_size)
    pages = torch.randn(num_pages + 7, block_size, kv_heads, 2 * head, generator=gen)
    block_ids = torch.randperm(num_pages + 7, generator=gen)[:num_pages]
    # the query as a view of a fused QKV row, as the layer hands it over
    qkv = torch.randn(q_len, (num_heads + 2 * kv_heads) * head, generator=gen)
    q = qkv[:, : num_heads * head].view(q_len, num_heads, head)
    sinks = torch.randn(num_heads, generator=gen)
    return q.bfloat16(), pages.bfloat16(), block_ids, sinks


def _reference(q, pages, block_ids, context, scale, window, sinks):
    """Float64 attention of every row over its visible keys (plus the sink column)."""
    q_len, num_heads, head = q.shape
    kv_heads = pages.shape[2]
    seq_len = context + q_len
    kv = pages.index_select(0, block_ids).reshape(-1, kv_heads, 2 * head)[:seq_len].double()
    group = num_heads // kv_heads
    k = kv[..., :head].repeat_interleave(group, dim=1)
    v = kv[..., head:].repeat_interleave(group, dim=1)
    scores = torch.einsum("ihd,jhd->hij", q.double(), k) * scale
    pos = torch.arange(context, seq_len).unsqueeze(1)
    key = torch.arange(seq_len).unsqueeze(0)
    keep = key <= pos
    if window is not None:
        keep &= key > pos - window
    scores = scores.masked_fill(~keep, float("-inf"))
    if sinks is not None:
        sink_col = sinks.double().view(num_heads, 1, 1).expand(num_heads, q_len, 1)
        probs = torch.cat([scores, sink_col], dim=-1).softmax(-1)[..., :-1]
    else:
        probs = scores.softmax(-1)
    return torch.einsum("hij,jhd->ihd", probs, v)


def _attend(q, pages, block_ids, context, window, sinks, out_dtype=torch.bfloat16):
    out = torch.full(q.shape, float("nan"), dtype=out_dtype)
    host_prefill.paged_prefill(
        q,
        pages,
        block_ids,
        context,
        q.shape[2] ** -0.5,
        out,
        sliding_window=window,
        sinks=sinks,
    )
    return out


@pytest.mark.parametrize("kernel", ["plugin", "torch"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "-".join(map(str, s)))
def test_each_prefill_kernel_matches_float64(prefill_kernel, kernel, shape):
    q_len, context, num_heads, kv_heads, head, block_size, window, with_sinks = shape
    prefill_kernel(kernel)
    if kernel == "plugin":
        _needs_kernel()
    q, pages, block_ids, sinks = _case(q_len, context, num_heads, kv_heads, head, block_size)
    sinks = sinks if with_sinks else None
    before = host_prefill.kernel_calls()
    got = _attend(q, pages, block_ids, context, window, sinks)
    # the forced kernel is the one that ran
    assert host_prefill.kernel_calls() - before == (1 if kernel == "plugin" else 0)
    want = _reference(q, pages, block_ids, context, head**-0.5, window, sinks)
    torch.testing.assert_close(got.double(), want, atol=BF16_ATOL, rtol=0)


def test_plugin_kernel_writes_other_output_dtypes(prefill_kernel):
    """A float32 destination gets the kernel's bf16 result (the layer's output
    buffer is the model's dtype, which on the cpu target may differ)."""
    prefill_kernel("plugin")
    _needs_kernel()
    q, pages, block_ids, _ = _case(290, 20, 9, 3, 64, 64, seed=3)
    got = _attend(q, pages, block_ids, 20, None, None, out_dtype=torch.float32)
    want = _attend(q, pages, block_ids, 20, None, None)
    assert torch.equal(got, want.float())


def test_plugin_and_torch_kernels_agree_at_length(prefill_kernel):
    """A 3000-token prompt in a 1000-token chunk after 2000 of context: the two
    kernels within bf16 rounding of each other (many key blocks, the last
    query blocks the longest)."""
    q, pages, block_ids, _ = _case(1000, 2000, 9, 3, 64, 64, seed=5)
    prefill_kernel("torch")
    reference = _attend(q, pages, block_ids, 2000, None, None).double()
    prefill_kernel("plugin")
    _needs_kernel()
    got = _attend(q, pages, block_ids, 2000, None, None).double()
    torch.testing.assert_close(got, reference, atol=BF16_ATOL, rtol=0)


def test_auto_leaves_cpus_with_a_tile_unit_on_torch(prefill_kernel, monkeypatch):
    """``auto`` takes the plugin's kernel where it runs, except on CPUs with AMX,
    where PyTorch's flash kernel can use the tile unit; float32 always takes
    PyTorch's (the kernel's products are bf16)."""
    prefill_kernel("auto")
    _needs_kernel()
    assert host_prefill.kernel_choice() == "plugin"
    flags = host_prefill.cpu_flags() | {"amx_bf16", "amx_tile"}
    monkeypatch.setattr(host_prefill, "cpu_flags", lambda: flags)
    host_prefill.kernel_choice.cache_clear()
    assert host_prefill.kernel_choice() == "torch"
    monkeypatch.undo()
    prefill_kernel("auto")
    q, pages, block_ids, _ = _case(260, 0, 4, 2, 64, 64)
    before = host_prefill.kernel_calls()
    _attend(q.float(), pages.float(), block_ids, 0, None, None, out_dtype=torch.float32)
    assert host_prefill.kernel_calls() == before


def test_forced_plugin_kernel_is_refused_at_start_up_where_it_cannot_run(
    prefill_kernel, monkeypatch
):
    """``SPYRE_CPU_PREFILL_KERNEL=plugin`` with no build up to the forced ISA (here
    ``SPYRE_CPU_ISA=avx2``, as on an AVX2-only CPU) fails in the user's process,
    naming the setting and the fix."""
    monkeypatch.setenv("SPYRE_CPU_ISA", "avx2")
    device.reset_for_tests()
    prefill_kernel("plugin")
    with pytest.raises(ValueError, match=r"SPYRE_CPU_PREFILL_KERNEL=plugin cannot be used.*Unset"):
        config_checks.check_prefill_kernel(None)
