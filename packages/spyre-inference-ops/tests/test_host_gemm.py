"""The cpu target's host GEMM kernel against float64 PyTorch products.

The kernel (``csrc/host_gemm.c``) reads bfloat16/float16 ``[in, out]`` weights
and accumulates in float32. The reference here is torch's float64 matmul of the
same values; float32 accumulation over K terms stays within ``K * eps32`` of it
relative to ``sum |x| |w|``. Beyond closeness the kernel promises batch
invariance (a row's bits do not depend on how many rows share the call, or on
the thread count), which the decode path relies on so that a sequence decodes
the same alone or in a batch; those checks are bitwise.
"""

from __future__ import annotations

import pytest
import torch

from spyre_inference.ops.host_gemm import host_gemm_w16, kernel_unavailable_reason

_REASON = kernel_unavailable_reason(torch.bfloat16)
pytestmark = pytest.mark.skipif(_REASON is not None, reason=f"host GEMM kernel: {_REASON}")

EPS32 = torch.finfo(torch.float32).eps


def _inputs(m: int, k: int, n: int, dtype: torch.dtype, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g)
    w = (torch.randn(k, n, generator=g) / k**0.5).to(dtype)
    return x, w


def _assert_close_to_float64(y: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> None:
    ref = x.double() @ w.double()
    bound = x.double().abs() @ w.double().abs()
    k = x.shape[-1]
    err = (y.double() - ref).abs()
    assert y.dtype == torch.float32
    assert torch.all(err <= 2 * k * EPS32 * bound + 1e-30), float((err / (bound + 1e-30)).max())


# Row counts cover both paths (<= 4 rows stream, more rows use register tiles
# of 6/4/2) and their remainders; column counts cover whole 16-column panels,
# 8-column vectors and scalar tails; K covers odd lengths and a 4-row remainder.
@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 7, 8, 13, 32, 70])
@pytest.mark.parametrize(("k", "n"), [(64, 64), (100, 37), (576, 960), (33, 8), (7, 130)])
def test_matches_float64(m, k, n):
    x, w = _inputs(m, k, n, torch.bfloat16)
    _assert_close_to_float64(host_gemm_w16(x, w), x, w)


@pytest.mark.parametrize("m", [1, 3, 9])
def test_float16_weights(m):
    x, w = _inputs(m, 96, 72, torch.float16, seed=1)
    _assert_close_to_float64(host_gemm_w16(x, w), x, w)


def test_strided_weight_and_leading_dims():
    """A column slice of a wider matrix (row stride != columns) and a 3-D,
    bfloat16 activation: the op widens x exactly and keeps its leading dims."""
    x, wide = _inputs(6, 128, 200, torch.bfloat16, seed=2)
    w = wide[:, 3:131]
    assert not w.is_contiguous() and w.stride(1) == 1
    xb = x.bfloat16().reshape(2, 3, 128)
    y = host_gemm_w16(xb, w)
    assert y.shape == (2, 3, 128)
    _assert_close_to_float64(y.reshape(6, 128), xb.float().reshape(6, 128), w)


def test_rows_do_not_depend_on_batch_size():
    """Bitwise: each row equals the same row computed alone, and in batches of
    other sizes (both kernel paths)."""
    x, w = _inputs(40, 320, 200, torch.bfloat16, seed=3)
    full = host_gemm_w16(x, w)
    alone = torch.cat([host_gemm_w16(x[i : i + 1], w) for i in range(40)])
    assert torch.equal(full, alone)
    for m in (2, 4, 5, 6, 11, 33):
        assert torch.equal(host_gemm_w16(x[:m], w), full[:m])


@pytest.mark.parametrize("m", [1, 2, 3, 4])
def test_few_rows_across_column_blocks(m):
    """Up to 4 rows the kernel cuts the columns into blocks whose rows of the
    output fit in L1 (4096 columns at one row, 1024 at four): a width that is
    not a whole number of blocks, with an 8-column vector and a scalar tail,
    is within float32 rounding and each row equals the row computed alone."""
    x, w = _inputs(m, 70, 4096 + 1024 + 24 + 5, torch.bfloat16, seed=6)
    y = host_gemm_w16(x, w)
    _assert_close_to_float64(y, x, w)
    assert torch.equal(y, torch.cat([host_gemm_w16(x[i : i + 1], w) for i in range(m)]))


def test_rows_do_not_depend_on_threads():
    x, w = _inputs(9, 256, 1000, torch.bfloat16, seed=4)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = [host_gemm_w16(x[:m], w) for m in (1, 9)]
        torch.set_num_threads(max(2, before))
        many = [host_gemm_w16(x[:m], w) for m in (1, 9)]
    finally:
        torch.set_num_threads(before)
    assert all(torch.equal(a, b) for a, b in zip(one, many, strict=True))


def test_inside_a_compiled_graph():
    """The op is one opaque node in an Inductor graph (as in the block graphs):
    same result as eager, no graph break."""

    def f(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return torch.relu(host_gemm_w16(x.float(), w)).to(x.dtype)

    x, w = _inputs(5, 64, 48, torch.bfloat16, seed=5)
    xb = x.bfloat16()
    compiled = torch.compile(f, backend="inductor", fullgraph=True, dynamic=False)
    assert torch.equal(compiled(xb, w), f(xb, w))


def test_the_op_runs_its_cpp_kernel_where_it_is_built():
    """The dispatcher picks the C++ kernel over the composite Python one, and both
    run the same build of the kernel: the same bits."""
    from spyre_inference.ops import host_gemm
    from spyre_inference.ops.linear_op import native_kernels_unavailable_reason

    reason = native_kernels_unavailable_reason()
    if reason is not None:
        pytest.skip(reason)
    assert host_gemm.dispatch() == "native"
    assert torch._C._dispatch_has_kernel_for_dispatch_key(host_gemm.QUALNAME, "CPU")
    for i, (m, k, n) in enumerate(((1, 576, 960), (4, 100, 37), (13, 1536, 200))):
        for dtype in (torch.bfloat16, torch.float16):
            x, w = _inputs(m, k, n, dtype, seed=300 + i)
            xb = x.to(dtype).view(1, m, k)  # leading dims and a 16-bit x, widened by the op
            y = host_gemm_w16(xb, w)
            assert y.dtype == torch.float32 and y.shape == (1, m, n)
            assert torch.equal(y, host_gemm.host_gemm_w16_in_python(xb, w)), (m, k, n, dtype)


@pytest.mark.parametrize("which", ["native", "python"])
def test_bad_arguments_are_errors(which):
    from spyre_inference.ops import host_gemm

    if which == "python":
        op = host_gemm.host_gemm_w16_in_python
    elif host_gemm.dispatch() != "native":
        pytest.skip("no C++ toolchain: the op's kernel is the Python one")
    else:
        op = host_gemm_w16

    x, w = _inputs(2, 16, 8, torch.bfloat16)
    with pytest.raises(ValueError, match="bfloat16/float16 weight"):
        op(x, w.float())
    with pytest.raises(ValueError, match="features"):
        op(x[:, :15], w)


# ---- the per-ISA builds ------------------------------------------------------

# Shapes crossing every path of both builds: few rows and many rows, 32-column
# (AVX-512) and 16-column (AVX2) panels with ragged last panels, a 16-wide body
# with an 8-wide remainder and a scalar tail, K below and above the split.
_ISA_SHAPES = [
    (m, k, n)
    for m in (1, 2, 4, 5, 8, 12, 13, 25, 40)
    for (k, n) in ((576, 960), (100, 37), (33, 8), (7, 130), (1536, 200), (64, 56), (70, 4200))
]


def _forced_isa(monkeypatch, isa: str):
    from spyre_inference.ops import host_gemm
    from spyre_inference.platform import device as dev

    monkeypatch.setenv("SPYRE_CPU_ISA", isa)
    dev.reset_for_tests()
    host_gemm.reset_for_tests()
    return host_gemm


@pytest.fixture
def restore_isa():
    yield
    from spyre_inference.ops import host_gemm
    from spyre_inference.platform import device as dev

    dev.reset_for_tests()
    host_gemm.reset_for_tests()


@pytest.mark.parametrize("isa", ["avx2", "avx512"])
def test_each_isa_build_matches_float64_and_the_avx2_bits(monkeypatch, restore_isa, isa):
    """SPYRE_CPU_ISA forces a build: it is the one loaded, it is within float32
    rounding of float64, and its bits equal the AVX2 build's on every shape (the
    builds run the same FMA chains), so a machine's ISA never changes a token."""
    from spyre_inference.platform.native_build import AVX512_CPU_FLAGS, cpu_flags

    if isa == "avx512" and not set(AVX512_CPU_FLAGS) <= cpu_flags():
        pytest.skip("this CPU has no AVX-512 F/BW/VL/DQ")
    host_gemm = _forced_isa(monkeypatch, "avx2")
    assert host_gemm.kernel_isa() == "avx2"
    inputs = []
    for i, (m, k, n) in enumerate(_ISA_SHAPES):
        for dtype in (torch.bfloat16, torch.float16):
            x, w = _inputs(m, k, n, dtype, seed=100 + i)
            inputs.append((x, w, host_gemm_w16(x, w)))
    host_gemm = _forced_isa(monkeypatch, isa)
    assert host_gemm.kernel_isa() == isa
    for x, w, avx2_bits in inputs:
        y = host_gemm_w16(x, w)
        _assert_close_to_float64(y, x, w)
        assert torch.equal(y, avx2_bits), (tuple(x.shape), tuple(w.shape), w.dtype)


def test_forcing_an_isa_the_cpu_lacks_names_it(monkeypatch, restore_isa):
    from spyre_inference.platform.native_build import AVX512_CPU_FLAGS, cpu_flags

    lacking = [
        isa for isa, flags in (("avx512", AVX512_CPU_FLAGS),) if not set(flags) <= cpu_flags()
    ]
    if not lacking:
        pytest.skip("this CPU runs every build")
    host_gemm = _forced_isa(monkeypatch, lacking[0])
    reason = host_gemm.kernel_unavailable_reason(torch.bfloat16)
    assert reason is not None and f"SPYRE_CPU_ISA={lacking[0]}" in reason
