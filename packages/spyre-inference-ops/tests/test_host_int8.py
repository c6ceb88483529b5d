"""The cpu target's INT8 x INT8 -> INT32 product against integer matmul and ``torch._int_mm``.

``host_int8.int8_mm`` runs the plugin's kernel (``csrc/host_int8_mm.c``): its
few-rows path for up to 4 rows, and for more rows either ``torch._int_mm``
(where the CPU has AVX-512 VNNI, its oneDNN path) or the kernel's many-rows
path (elsewhere), called from the op's C++ kernel (``csrc/linear_dispatch.cpp``)
or, without a C++ toolchain, from Python. Integer sums are exact, so every check
here is bitwise: against PyTorch's int64 matmul of the same values, and against
``torch._int_mm`` itself, on both builds forced with ``SPYRE_CPU_ISA``, with each
many-rows choice forced (the CPU's flags as the choice reads them), through both
op kernels, and with the kernel switched off (``SPYRE_CPU_GEMM_KERNEL=torch``).
"""

from __future__ import annotations

import pytest
import torch

from spyre_inference.ops import host_int8
from spyre_inference.platform import device as dev

_REASON = host_int8.kernel_unavailable_reason()
pytestmark = pytest.mark.skipif(_REASON is not None, reason=f"INT8 host kernel: {_REASON}")

# Rows 1-4 (the few-rows path) and 5-17 (oneDNN or the many-rows path: whole
# tiles of 6 and 8 rows and their remainders); K with remainders of the 4-row
# groups, of the threads' shares and of the 2-row pairs, one below 64 (a single
# thread), one over a packed panel's 1024; N with whole 2-vector panels, a
# single-vector panel and scalar tails of both builds; SmolLM2's shapes.
_SHAPES = [
    (m, k, n)
    for m in (1, 2, 3, 4, 5, 9, 13, 17)
    for (k, n) in (
        (576, 960),
        (1536, 576),
        (577, 963),
        (130, 17),
        (33, 8),
        (3, 130),
        (64, 4200),
        (2049, 56),
    )
]


def _inputs(m: int, k: int, n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(-128, 128, (m, k), dtype=torch.int8, generator=g)
    w = torch.randint(-128, 128, (k, n), dtype=torch.int8, generator=g)
    return x, w


def _exact(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return (x.long() @ w.long()).int()


@pytest.fixture
def forced(monkeypatch):
    """Set a setting and reload the kernel's choice; undone after the test."""

    def force(name: str, value: str) -> None:
        monkeypatch.setenv(name, value)
        dev.reset_for_tests()
        host_int8.reset_for_tests()

    def many_rows(choice: str) -> None:
        """Decide the many-rows path as on a CPU with (``onednn``) or without
        (``kernel``) the flag the choice reads."""
        flags = set(host_int8.cpu_flags()) - {host_int8.ONEDNN_INT8_FLAG}
        if choice == "onednn":
            flags.add(host_int8.ONEDNN_INT8_FLAG)
        monkeypatch.setattr(host_int8, "cpu_flags", lambda: frozenset(flags))
        host_int8.reset_for_tests()

    force.many_rows = many_rows

    yield force
    monkeypatch.undo()
    dev.reset_for_tests()
    host_int8.reset_for_tests()


def _op_kernel(which: str):
    """The op as the block graphs call it (its C++ kernel where it is built), or its
    Python kernel."""
    if which == "python":
        return host_int8.int8_mm_in_python
    if host_int8.dispatch() != "native":
        pytest.skip("no C++ toolchain: the op's kernel is the Python one")
    return host_int8.int8_mm


def test_the_op_runs_its_cpp_kernel_where_it_is_built():
    """The dispatcher picks the C++ kernel over the composite Python one."""
    from spyre_inference.ops.linear_op import native_kernels_unavailable_reason

    reason = native_kernels_unavailable_reason()
    if reason is not None:
        pytest.skip(reason)
    assert host_int8.dispatch() == "native"
    assert torch._C._dispatch_has_kernel_for_dispatch_key(host_int8.QUALNAME, "CPU")


@pytest.mark.parametrize("many_rows", ["kernel", "onednn"])
@pytest.mark.parametrize("which", ["native", "python"])
@pytest.mark.parametrize("isa", ["avx2", "avx512"])
def test_each_build_equals_integer_matmul_and_int_mm(forced, isa, which, many_rows):
    from spyre_inference.platform.native_build import AVX512_CPU_FLAGS, cpu_flags

    if isa == "avx512" and not set(AVX512_CPU_FLAGS) <= cpu_flags():
        pytest.skip("this CPU has no AVX-512 F/BW/VL/DQ")
    forced("SPYRE_CPU_ISA", isa)
    forced.many_rows(many_rows)
    assert host_int8.kernel_isa() == isa
    limit = host_int8.HOST_ROWS_MAX if many_rows == "onednn" else host_int8.ALL_ROWS
    assert host_int8.max_rows() == limit
    described = host_int8.describe()  # what the benchmark reports name
    assert described is not None and f"{isa} build" in described
    assert ("every row count" in described) == (many_rows == "kernel")
    mm = _op_kernel(which)
    for i, (m, k, n) in enumerate(_SHAPES):
        x, w = _inputs(m, k, n, seed=i)
        assert host_int8.serves(m, k) == (m <= limit)
        y = mm(x, w)
        assert y.dtype == torch.int32
        assert torch.equal(y, _exact(x, w)), (m, k, n)
        if k >= 16:  # oneDNN's lower bound on K here
            assert torch.equal(y, torch._int_mm(x, w)), (m, k, n)


@pytest.mark.parametrize("which", ["native", "python"])
def test_switched_off_it_is_int_mm(forced, which):
    forced("SPYRE_CPU_GEMM_KERNEL", "torch")
    assert host_int8.kernel_unavailable_reason() == "SPYRE_CPU_GEMM_KERNEL=torch"
    assert not host_int8.serves(1, 576)
    x, w = _inputs(1, 576, 960, seed=7)
    assert torch.equal(_op_kernel(which)(x, w), _exact(x, w))


@pytest.mark.parametrize("rows", [2, 11])
def test_extremes_do_not_overflow_int16_pairs(forced, rows):
    """-128 * -128 twice is 32768, one past int16: the kernel's pairs of products
    must be summed in int32 (vpmaddwd), never saturated (both paths)."""
    forced.many_rows("kernel")
    x = torch.full((rows, 1536), -128, dtype=torch.int8)
    w = torch.full((1536, 40), -128, dtype=torch.int8)
    w[::2, ::3] = 127
    assert torch.equal(host_int8.int8_mm(x, w), _exact(x, w))


@pytest.mark.parametrize("rows", [3, 14])
def test_rows_do_not_depend_on_threads_or_leading_dims(forced, rows):
    forced.many_rows("kernel")
    x, w = _inputs(rows, 700, 300, seed=11)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = host_int8.int8_mm(x, w)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(one, host_int8.int8_mm(x, w))
    assert torch.equal(host_int8.int8_mm(x.view(rows, 1, 700), w).view(rows, 300), one)
    # A column slice of a wider weight (row stride != columns), and rows of x
    # with a stride past their length.
    wide = _inputs(1, 700, 500, seed=12)[1]
    assert torch.equal(host_int8.int8_mm(x, wide[:, 100:400]), _exact(x, wide[:, 100:400]))
    xs = _inputs(rows, 900, 1, seed=13)[0][:, :700]
    assert torch.equal(host_int8.int8_mm(xs, w), _exact(xs, w))


def test_inside_a_compiled_graph():
    """One opaque node in an Inductor graph with the quantization around it, as
    in the block graphs of an INT8 W8A8 checkpoint."""

    def f(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        scale = x.abs().amax(-1, keepdim=True) / 127
        xq = (x / scale).round().clamp(-128, 127).to(torch.int8)
        return host_int8.int8_mm(xq, w).float() * scale

    x = torch.randn(2, 256)
    w = _inputs(1, 256, 96, seed=3)[1]
    compiled = torch.compile(f, backend="inductor", fullgraph=True, dynamic=False)
    assert torch.equal(compiled(x, w), f(x, w))


@pytest.mark.parametrize("which", ["native", "python"])
def test_bad_arguments_are_errors(which):
    mm = _op_kernel(which)
    x, w = _inputs(2, 16, 8, seed=0)
    with pytest.raises(ValueError, match="int8"):
        mm(x.float(), w)
    with pytest.raises(ValueError, match="features"):
        mm(x[:, :15], w)
