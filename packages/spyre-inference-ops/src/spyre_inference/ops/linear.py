"""The five vLLM parallel-linear classes with the transposed-weight fast path.

Each subclass is constructed exactly like its upstream class (same arguments,
same weights, same loaders) and, when the layer is unquantized, swaps in
:class:`~spyre_inference.ops.transposed_weight.SpyreUnquantizedLinearMethod`
so the weight is transposed once at load. Quantized layers keep their own
method. Forward is upstream's: fused projections stay fused (QKV returns the
whole ``[..., q+k+v]`` tensor and gate/up the whole ``[..., 2*d]`` one), the
row-parallel layer keeps upstream's all-reduce under TP.
"""

from __future__ import annotations

from typing import Any

from vllm.model_executor.layers.linear import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    ReplicatedLinear,
    RowParallelLinear,
)

from spyre_inference.ops._oot import spyre_oot
from spyre_inference.ops.transposed_weight import install_transposed_method


@spyre_oot(ReplicatedLinear)
class SpyreReplicatedLinear(ReplicatedLinear):
    """``ReplicatedLinear`` storing its weight transposed."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        install_transposed_method(self)


@spyre_oot(ColumnParallelLinear)
class SpyreColumnParallelLinear(ColumnParallelLinear):
    """``ColumnParallelLinear`` storing its weight transposed."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        install_transposed_method(self)


@spyre_oot(MergedColumnParallelLinear)
class SpyreMergedColumnParallelLinear(MergedColumnParallelLinear):
    """Fused gate/up projection; its ``[..., 2*d]`` output feeds upstream SiluAndMul."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        install_transposed_method(self)


@spyre_oot(QKVParallelLinear)
class SpyreQKVParallelLinear(QKVParallelLinear):
    """Fused QKV projection; the model's own ``qkv.split(...)`` slices its output."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # A gathered QKV output would be the full (all-rank) projection, which
        # the per-rank attention split cannot consume; upstream never asks for
        # it, and the plugin relies on that.
        assert not self.gather_output, "SpyreQKVParallelLinear requires gather_output=False"
        install_transposed_method(self)


@spyre_oot(RowParallelLinear)
class SpyreRowParallelLinear(RowParallelLinear):
    """``RowParallelLinear`` (o_proj, down_proj); upstream's TP all-reduce is kept."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        install_transposed_method(self)


__all__ = [
    "SpyreColumnParallelLinear",
    "SpyreMergedColumnParallelLinear",
    "SpyreQKVParallelLinear",
    "SpyreReplicatedLinear",
    "SpyreRowParallelLinear",
]
