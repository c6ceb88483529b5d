"""Registration of the cpu target's linear ops: ``spyre_inference::<name>(x, weight_t)``.

The host GEMM (:mod:`~spyre_inference.ops.host_gemm`), oneDNN on prepacked
weights (:mod:`~spyre_inference.ops.onednn_linear`) and the INT8 product
(:mod:`~spyre_inference.ops.host_int8`) are opaque ops the block graphs call
with the ``[in, out]`` weight of record. They are registered here,
through ``torch.library.Library`` rather than ``torch.library.custom_op``: the
ops run ~120 times per decode step (every linear of every layer), and
custom_op's Python wrapper cost ~65 us per call on the 2-core host it was
measured on, against ~24 us for a plain CPU kernel registration. They are
inference-only (vLLM runs under inference_mode): no autograd formula.

The C++ CPU kernels of the oneDNN and INT8 ops (``csrc/linear_dispatch.cpp``)
are one library, built once per machine and loaded once per process by
:func:`native_kernels_unavailable_reason`.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from pathlib import Path

import torch

from spyre_inference.platform.native_build import NativeKernelUnavailable, load_torch_extension

OP_NAMESPACE = "spyre_inference"

_NATIVE_SOURCE = Path(__file__).with_name("csrc") / "linear_dispatch.cpp"

LinearImpl = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def register_linear_op(
    name: str, impl: LinearImpl | None, result_dtype: Callable[[torch.Tensor], torch.dtype]
) -> torch.library.Library:
    """Define ``spyre_inference::<name>(Tensor x, Tensor weight_t) -> Tensor`` on the CPU.

    ``result_dtype(weight_t)`` is the output's dtype, for the fake (meta)
    implementation Dynamo traces with; the output is ``[*x.shape[:-1], out]``.
    ``impl=None`` leaves the CPU kernel to the caller (a C++ library, or a later
    ``lib.impl``). Keep the returned library alive as long as the op is used.
    """

    def fake(x: torch.Tensor, weight_t: torch.Tensor) -> torch.Tensor:
        return x.new_empty((*x.shape[:-1], weight_t.shape[1]), dtype=result_dtype(weight_t))

    lib = torch.library.Library(OP_NAMESPACE, "FRAGMENT")
    lib.define(f"{name}(Tensor x, Tensor weight_t) -> Tensor")
    if impl is not None:
        lib.impl(name, impl, "CPU")
    torch.library.register_fake(f"{OP_NAMESPACE}::{name}", fake, lib=lib)
    return lib


@functools.cache
def native_kernels_unavailable_reason() -> str | None:
    """Load the linear ops' C++ CPU kernels; None once loaded, else why they cannot be.

    Tried once per process, on first use (a model load), not at import: the
    user's process and processes that never load weights skip the build.
    """
    try:
        load_torch_extension(_NATIVE_SOURCE, python_module=False)
    except NativeKernelUnavailable as exc:
        return str(exc)
    return None


def as_rows(name: str, x: torch.Tensor, weight_t: torch.Tensor) -> tuple[torch.Tensor, int]:
    """``x`` as ``[rows, in]`` for a product with the ``[in, out]`` weight, and ``out``.

    The Python linear ops' shared argument check: ``x``'s last dimension must be
    the weight's rows; the result is reshaped back with ``x.shape[:-1]``.
    """
    k, n = weight_t.shape
    if x.shape[-1] != k:
        raise ValueError(f"{name}: x has {x.shape[-1]} features, the weight {k} rows")
    return x.reshape(-1, k), n


__all__ = ["OP_NAMESPACE", "as_rows", "native_kernels_unavailable_reason", "register_linear_op"]
