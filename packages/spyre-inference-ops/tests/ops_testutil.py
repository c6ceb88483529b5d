"""Helpers shared by the ops tests (module name kept unique across packages).

Reference layers are vLLM's own classes. Once the plugin's swaps are
registered, ``ColumnParallelLinear(...)`` builds the Spyre class; to build the
upstream class for comparison, :func:`upstream_layers` takes the plugin's
entries out of vLLM's real out-of-tree registry for the duration of a ``with``
block and puts them back afterwards.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

#: Tolerances for bfloat16 comparisons: one bf16 ulp at 1.0 is 2**-7 = 7.8e-3;
#: two independently rounded bf16 results can differ by about one ulp of the
#: output, so outputs of order 1 are compared at rtol = atol = 1.6e-2.
BF16_TOL = {"rtol": 1.6e-2, "atol": 1.6e-2}
#: float32 comparisons: only the summation order differs.
FP32_TOL = {"rtol": 1e-5, "atol": 1e-5}


def tol(dtype: torch.dtype) -> dict[str, float]:
    return BF16_TOL if dtype == torch.bfloat16 else FP32_TOL


@contextlib.contextmanager
def upstream_layers() -> Iterator[None]:
    """Build vLLM's own layer classes inside this block (swaps suspended)."""
    from vllm.model_executor.custom_op import op_registry_oot

    from spyre_inference.platform.layer_swaps import declared_swaps

    saved = {
        name: op_registry_oot.pop(name) for name in declared_swaps() if name in op_registry_oot
    }
    try:
        yield
    finally:
        op_registry_oot.update(saved)


@contextlib.contextmanager
def default_dtype(dtype: torch.dtype) -> Iterator[None]:
    """vLLM creates parameters in torch's default dtype (the model dtype)."""
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


def process_after_loading(layer: torch.nn.Module) -> None:
    """What vLLM's loader does for each layer once its weights are in."""
    method = getattr(layer, "quant_method", None)
    if method is not None:
        method.process_weights_after_loading(layer)
