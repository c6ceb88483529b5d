"""Both decoder backends against plain PyTorch attention (dense SDPA, float64).

Backends under test:

* ``token_major``: token-major pages, decodes batched into the batched-decode
  kernel (the default);
* ``token_major_per_seq``: token-major pages, batched decode off
  (``SPYRE_BATCHED_DECODE=0``): every sequence through the per-sequence kernel;
* ``head_major``: head-major pages, per-head store, 2-D page gather.

The matrix runs the kernels eagerly (``--enforce-eager`` config; for the
head-major backend, whose kernels always compile, the layer's compile switch
is turned off so the matrix does not pay one Inductor compile per shape);
``test_compiled_*`` run the same cases through the compiled graphs.

Tolerances (attn_testutil): float32 within 5e-6 abs / 1e-5 rel of the float64
reference; bfloat16 within 3e-2 abs / rel.
"""

from __future__ import annotations

import pytest
import torch
from attn_testutil import (
    BF16_TOL,
    FP32_TOL,
    Case,
    check,
    make_impl,
    prepare,
    reference,
    reset_settings,
    run_backend,
)

from spyre_inference.attention import ops, policy
from spyre_inference.attention.backends.head_major import SpyreHeadMajorAttentionBackend
from spyre_inference.attention.backends.token_major import SpyreAttentionBackend
from spyre_inference.attention.ops import compiled as compiled_ops
from spyre_inference.platform import settings

BACKENDS = {
    "token_major": (SpyreAttentionBackend, "1"),
    "token_major_per_seq": (SpyreAttentionBackend, "0"),
    "head_major": (SpyreHeadMajorAttentionBackend, None),
}


@pytest.fixture(params=sorted(BACKENDS))
def backend(request, monkeypatch):
    cls, batched = BACKENDS[request.param]
    reset_settings(monkeypatch, SPYRE_BATCHED_DECODE=batched)
    yield cls
    reset_settings(monkeypatch)


def run_case(backend, vllm_config, case: Case) -> torch.Tensor:
    if backend is SpyreHeadMajorAttentionBackend:
        block_size = vllm_config.cache_config.block_size
        step = prepare(backend, case, block_size)
        impl = make_impl(backend, vllm_config, case)
        assert impl.compile_kernels  # always compiled, even under --enforce-eager ...
        impl.compile_kernels = False  # ... but the matrix checks the math eagerly
        out = run_backend(backend, vllm_config, step, impl=impl)
        n = step.num_actual_tokens
        tol = FP32_TOL if case.dtype == torch.float32 else BF16_TOL
        torch.testing.assert_close(out[:n].double(), reference(step), **tol)
        assert torch.equal(out[n:], torch.zeros_like(out[n:]))
        return out
    return check(backend, vllm_config, case)


WORKLOADS = {
    "single_decode": ([200], [1]),
    "single_prefill": ([50], [50]),
    "many_decodes": ([10, 65, 130, 257, 64, 1], [1, 1, 1, 1, 1, 1]),
    "small_prefills": ([5, 17, 33, 2], [5, 17, 33, 2]),
    "mixed": ([300, 40, 129, 7, 65], [1, 40, 1, 7, 1]),
    "prefix_cached": ([150, 200, 128 + 9], [22, 50, 9]),
    "prefix_cached_block_aligned": ([192, 70], [64, 6]),
    # 1500 tokens = 24 pages of 64 (bucket 32); the 60-row chunk crosses a page.
    "long_context": ([1500, 1000, 1800], [1, 60, 1]),
}


@pytest.fixture(params=["cpu", "cpu_prefill_flash", "cpu_prefill_kernel", "cpu_tiled", "card"])
def kernel_form(request, monkeypatch):
    """How the kernels run a step's tiles.

    * ``cpu``: the cpu target's default: decode batches and prefills shorter than
      ``policy.HOST_ROWS_MAX_QUERY`` (all of these workloads') through the host
      decode kernel (``ops.host_decode``), longer prefills through the host flash
      kernel (``ops.host_prefill``); the head-major layout through its graphs,
      one tile through the CPU flash kernel;
    * ``cpu_prefill_flash``: every multi-row sequence (and, without batched
      decode, every decode) through the host prefill path on PyTorch's flash
      kernel (``SPYRE_CPU_PREFILL_KERNEL=torch``);
    * ``cpu_prefill_kernel``: the same rows on the plugin's AVX-512 BF16
      prefill kernel (``SPYRE_CPU_PREFILL_KERNEL=plugin``; bfloat16 only, so
      float32 cases still take PyTorch's; skipped on CPUs without AVX-512 BF16);
    * ``cpu_tiled``: the flash kernel over 256 KiB tiles (several per
      sequence here), merged by log-sum-exp, decode batches too;
    * ``card``: the card's form, one page per online-softmax step with
      matmuls and running statistics.
    """
    if request.param in ("cpu_prefill_flash", "cpu_prefill_kernel"):
        from spyre_inference.attention.ops import host_prefill

        if request.param == "cpu_prefill_kernel" and host_prefill.kernel_unavailable_reason():
            pytest.skip(f"prefill kernel: {host_prefill.kernel_unavailable_reason()}")
        monkeypatch.setattr(policy, "HOST_ROWS_MAX_QUERY", 1)
        kernel = "plugin" if request.param == "cpu_prefill_kernel" else "torch"
        with pytest.MonkeyPatch.context() as env:
            env.setenv("SPYRE_CPU_PREFILL_KERNEL", kernel)
            settings.reset_cache()
            host_prefill.reset_for_tests()
            yield request.param
        settings.reset_cache()
        host_prefill.reset_for_tests()
        return
    elif request.param == "cpu_tiled":
        monkeypatch.setattr(policy, "CPU_TILE_BYTES", 256 << 10)
        monkeypatch.setattr(policy, "CPU_DECODE_KERNEL", False)
    elif request.param == "card":
        monkeypatch.setattr(policy, "CPU_TILE_BYTES", 1)
        monkeypatch.setattr(policy, "CPU_FLASH_ATTENTION", False)
        monkeypatch.setattr(policy, "CPU_DECODE_KERNEL", False)
    yield request.param


@pytest.mark.parametrize("workload", sorted(WORKLOADS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_matches_dense_reference(backend, vllm_config, workload, dtype, kernel_form):
    seq_lens, query_lens = WORKLOADS[workload]
    run_case(backend, vllm_config, Case(seq_lens, query_lens, dtype=dtype))


def test_kernel_form_choice(monkeypatch):
    assert policy.use_flash(None) and not policy.use_flash(30.0)
    monkeypatch.setattr(policy, "CPU_FLASH_ATTENTION", False)
    assert not policy.use_flash(None)


def test_tile_sizes():
    """One page per tile on the card's setting; the cpu budget otherwise."""
    assert policy.pages_per_tile(64, num_heads=4, query_rows=64, token_bytes=256) > 1
    # A batch of 32 decodes of 3 KV heads x 128 (bf16): 768 B per token each.
    tile = policy.pages_per_tile(128, num_seqs=32, num_heads=9, token_bytes=768)
    assert tile * 128 * 32 * 768 <= policy.CPU_TILE_BYTES


@pytest.mark.parametrize(
    ("num_heads", "num_kv_heads"),
    [(4, 4), (4, 2), (8, 2), (8, 1)],
    ids=["mha_ratio1", "gqa_ratio2", "gqa_ratio4", "mqa"],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_head_grouping(backend, vllm_config, num_heads, num_kv_heads, dtype, kernel_form):
    seq_lens, query_lens = WORKLOADS["mixed"]
    case = Case(seq_lens, query_lens, num_heads=num_heads, num_kv_heads=num_kv_heads, dtype=dtype)
    run_case(backend, vllm_config, case)


@pytest.mark.parametrize("window", [1, 5, 64, 100])
def test_sliding_window(backend, vllm_config, window, kernel_form):
    # Long enough that whole pages fall before the window for the decodes,
    # and prefills whose rows see a window inside their own chunk.
    case = Case([300, 40, 200, 7, 150], [1, 40, 30, 7, 1], sliding_window=window)
    run_case(backend, vllm_config, case)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_logits_soft_cap(backend, vllm_config, dtype):
    # A query gain that pushes scores well past the cap, so capping matters.
    case = Case([300, 40, 150, 90], [1, 40, 22, 1], soft_cap=5.0, query_gain=6.0, dtype=dtype)
    run_case(backend, vllm_config, case)


def test_soft_cap_and_window_together(backend, vllm_config):
    case = Case([260, 50, 99], [3, 50, 1], sliding_window=33, soft_cap=4.0, query_gain=5.0)
    run_case(backend, vllm_config, case)


def test_head_size_64(backend, vllm_config):
    """The spec's smallest real head size (one stick), GQA, mixed step."""
    run_case(backend, vllm_config, Case([130, 20, 70], [1, 20, 1], head_size=64))


# ---- attention sinks (gpt-oss) ---------------------------------------------------


@pytest.mark.parametrize("workload", ["mixed", "long_context", "prefix_cached"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_attention_sinks(backend, vllm_config, workload, dtype, kernel_form):
    """Every kernel form and backend (the host kernel included) against the float64
    reference of ``softmax([scores, sink])`` with the sink column dropped."""
    seq_lens, query_lens = WORKLOADS[workload]
    case = Case(seq_lens, query_lens, num_heads=8, num_kv_heads=2, sinks=True, dtype=dtype)
    run_case(backend, vllm_config, case)


def test_attention_sinks_with_window_gqa4(backend, vllm_config, kernel_form):
    """gpt-oss's sliding layers: sinks with a window, 4 query heads per KV head."""
    case = Case([300, 40, 200, 7], [1, 40, 30, 7], num_heads=8, num_kv_heads=2, sinks=True,
                sliding_window=50)  # fmt: skip
    run_case(backend, vllm_config, case)


def test_sinks_change_the_output(vllm_config):
    """The sink case is not the plain case: the reference without sinks differs."""
    seq_lens, query_lens = WORKLOADS["mixed"]
    with_sinks = check(SpyreAttentionBackend, vllm_config, Case(seq_lens, query_lens, sinks=True))
    plain = check(SpyreAttentionBackend, vllm_config, Case(seq_lens, query_lens))
    n = sum(query_lens)
    assert (with_sinks[:n] - plain[:n]).abs().max() > 0.05


# ---- ALiBi (token-major only) ---------------------------------------------------


@pytest.mark.parametrize("batched", ["1", "0"], ids=["batched_decode", "per_seq"])
@pytest.mark.parametrize("workload", ["mixed", "long_context", "prefix_cached"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_alibi_token_major(vllm_config, monkeypatch, batched, workload, dtype, kernel_form):
    reset_settings(monkeypatch, SPYRE_BATCHED_DECODE=batched)
    seq_lens, query_lens = WORKLOADS[workload]
    case = Case(seq_lens, query_lens, num_heads=8, num_kv_heads=2, alibi=True, dtype=dtype)
    check(SpyreAttentionBackend, vllm_config, case)


def test_alibi_with_window_and_mqa(vllm_config):
    case = Case(
        [300, 40, 200], [1, 40, 30], num_heads=4, num_kv_heads=1, alibi=True, sliding_window=50
    )
    check(SpyreAttentionBackend, vllm_config, case)


# ---- the compiled graphs ------------------------------------------------------------


@pytest.mark.parametrize("workload", ["mixed", "long_context"])
def test_compiled_matches_reference(backend, compiled_vllm_config, workload, monkeypatch):
    """Through the Inductor graphs (one per bucket), as the card serves (the cpu
    target's host paths off)."""
    monkeypatch.setattr(policy, "CPU_DECODE_KERNEL", False)
    seq_lens, query_lens = WORKLOADS[workload]
    impl = make_impl(backend, compiled_vllm_config, Case(seq_lens, query_lens))
    assert impl.compile_kernels and impl.compile_store
    check(backend, compiled_vllm_config, Case(seq_lens, query_lens))
    # Compiled, not silently eager: the graphs exist in the process-wide cache.
    family = (
        ops.HEAD_MAJOR_ATTENTION
        if backend is SpyreHeadMajorAttentionBackend
        else ops.PAGE_ATTENTION
    )
    assert len(family) > 0 and compiled_ops.stats.total > 0


def test_compiled_multi_tile_online_softmax(backend, compiled_vllm_config, monkeypatch):
    """Several online-softmax steps inside one compiled graph.

    A 256 KiB budget gives 4-page tiles to the 64-row prefill chunk and the
    decode batch here (16 pages for a lone decode), so the 24..29-page
    sequences take 2 to 8 steps.
    """
    monkeypatch.setattr(policy, "CPU_TILE_BYTES", 256 << 10)
    seq_lens, query_lens = WORKLOADS["long_context"]
    # Soft-capped: the matmul form with running statistics ...
    check(backend, compiled_vllm_config, Case(seq_lens, query_lens, soft_cap=6.0))
    # ... and the flash form merging tiles by log-sum-exp.
    check(backend, compiled_vllm_config, Case(seq_lens, query_lens))


def test_compiled_gqa4_softcap_window_bf16(backend, compiled_vllm_config):
    case = Case(
        [300, 40, 200, 7],
        [1, 40, 30, 1],
        num_heads=8,
        num_kv_heads=2,
        sliding_window=70,
        soft_cap=5.0,
        query_gain=4.0,
        dtype=torch.bfloat16,
    )
    check(backend, compiled_vllm_config, case)


def test_compiled_alibi(compiled_vllm_config):
    seq_lens, query_lens = WORKLOADS["mixed"]
    case = Case(seq_lens, query_lens, num_heads=8, num_kv_heads=2, alibi=True)
    check(SpyreAttentionBackend, compiled_vllm_config, case)
