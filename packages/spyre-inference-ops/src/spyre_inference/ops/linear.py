"""The five vLLM parallel-linear classes with the transposed-weight fast path.

Each subclass is constructed exactly like its upstream class (same arguments,
same weights, same loaders) and, when the layer is unquantized, swaps in
:class:`~spyre_inference.ops.transposed_weight.SpyreUnquantizedLinearMethod`
so the weight is transposed once at load. Quantized layers keep their own
method. Forward is upstream's: fused projections stay fused (QKV returns the
whole ``[..., q+k+v]`` tensor and gate/up the whole ``[..., 2*d]`` one), the
row-parallel layer keeps upstream's all-reduce under TP.

Stick padding: when the platform widened ``head_dim`` / ``intermediate_size``
(:mod:`spyre_inference.platform.stick_pad`), the layers are built at the padded
width and their weight loaders zero-pad each checkpoint tensor before handing
it to upstream's loader (which then shards it for TP as usual): Q/K/V rows and
O columns per head, gate/up (or fc1) rows and down columns at the tail.
"""

from __future__ import annotations

from typing import Any

import torch
from vllm.model_executor.layers.linear import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    ReplicatedLinear,
    RowParallelLinear,
)

from spyre_inference.ops.stick_pad_load import (
    pad_mlp_output,
    pad_qkv_shard,
    pad_row_input,
)
from spyre_inference.ops.transposed_weight import (
    SpyreTransposedWeightMethod,
    install_transposed_method,
)
from spyre_inference.platform.layer_swaps import spyre_oot
from spyre_inference.platform.stick_pad import DimPad, StickPadPlan, current_plan


def _require_unquantized(layer: torch.nn.Module, what: str) -> None:
    """Padding rewrites plain weight tensors; packed quantized ones are not handled."""
    if not isinstance(layer.quant_method, SpyreTransposedWeightMethod):
        raise NotImplementedError(
            f"{layer.prefix or type(layer).__name__}: {what} needs stick padding, which "
            f"spyre-inference implements for unquantized weights only (this layer uses "
            f"{type(layer.quant_method).__name__})."
        )


def _padded(loaded: torch.Tensor, result: torch.Tensor) -> bool:
    return result is not loaded


@spyre_oot(ReplicatedLinear)
class SpyreReplicatedLinear(ReplicatedLinear):
    """``ReplicatedLinear`` storing its weight transposed."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        install_transposed_method(self)


@spyre_oot(ColumnParallelLinear)
class SpyreColumnParallelLinear(ColumnParallelLinear):
    """``ColumnParallelLinear`` storing its weight transposed.

    As the first projection of a plain (non-gated) MLP its output rows are
    zero-padded to the widened ``intermediate_size``.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._spyre_plan: StickPadPlan | None = current_plan()
        install_transposed_method(self)

    def _spyre_pad(self, param: torch.nn.Parameter, loaded: torch.Tensor) -> torch.Tensor:
        dim = getattr(param, "output_dim", None)
        if dim is None or getattr(param, "is_sharded_weight", False):
            return loaded
        out = pad_mlp_output(loaded, dim, self.output_size, self._spyre_plan)
        if _padded(loaded, out):
            _require_unquantized(self, "the MLP width")
        return out

    def weight_loader(self, param: torch.nn.Parameter, loaded_weight: torch.Tensor) -> None:
        super().weight_loader(param, self._spyre_pad(param, loaded_weight))

    def weight_loader_v2(self, param: Any, loaded_weight: torch.Tensor) -> None:
        super().weight_loader_v2(param, self._spyre_pad(param, loaded_weight))


class _ShardPaddingLoaders:
    """Loaders of a fused layer (gate/up, QKV): split, pad each shard, then upstream's.

    A checkpoint may hold the fused tensor at the original width; it is split
    into its shards (``_spyre_fused_parts``) and each shard goes through the
    loader again with its shard id, is padded (``_spyre_pad``) and handed to
    upstream's loader, which shards it for tensor parallelism as usual.
    """

    def _spyre_fused_parts(
        self, param: Any, loaded: torch.Tensor, shard_id: Any
    ) -> list[tuple[Any, torch.Tensor]] | None:
        raise NotImplementedError

    def _spyre_pad(self, param: Any, loaded: torch.Tensor, shard_id: Any) -> torch.Tensor:
        raise NotImplementedError

    def weight_loader(
        self, param: torch.nn.Parameter, loaded_weight: torch.Tensor, loaded_shard_id: Any = None
    ) -> None:
        parts = self._spyre_fused_parts(param, loaded_weight, loaded_shard_id)
        if parts is not None:
            for shard_id, part in parts:
                self.weight_loader(param, part, shard_id)
            return
        loaded_weight = self._spyre_pad(param, loaded_weight, loaded_shard_id)
        super().weight_loader(param, loaded_weight, loaded_shard_id)

    def weight_loader_v2(
        self, param: Any, loaded_weight: torch.Tensor, loaded_shard_id: Any = None
    ) -> None:
        parts = self._spyre_fused_parts(param, loaded_weight, loaded_shard_id)
        if parts is not None:
            for shard_id, part in parts:
                self.weight_loader_v2(param, part, shard_id)
            return
        loaded_weight = self._spyre_pad(param, loaded_weight, loaded_shard_id)
        super().weight_loader_v2(param, loaded_weight, loaded_shard_id)


@spyre_oot(MergedColumnParallelLinear)
class SpyreMergedColumnParallelLinear(_ShardPaddingLoaders, MergedColumnParallelLinear):
    """Fused gate/up projection; its ``[..., 2*d]`` output feeds upstream SiluAndMul.

    With a widened ``intermediate_size`` each of gate and up is zero-padded at
    its tail, so SiluAndMul's ``d = width // 2`` split lands on a stick boundary
    and the pad activations are ``silu(0) * 0 = 0``.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._spyre_plan: StickPadPlan | None = current_plan()
        install_transposed_method(self)
        mlp = self._spyre_plan.intermediate_size if self._spyre_plan else None
        if mlp is not None and mlp.padded in self.output_sizes:
            _require_unquantized(self, "the MLP width")

    def _spyre_fused_parts(
        self, param: Any, loaded: torch.Tensor, shard_id: Any
    ) -> list[tuple[int, torch.Tensor]] | None:
        """An on-disk fused gate_up at the original width, split per shard (else None)."""
        mlp = self._spyre_plan.intermediate_size if self._spyre_plan else None
        dim = getattr(param, "output_dim", None)
        if shard_id is not None or mlp is None or dim is None:
            return None
        if any(size != mlp.padded for size in self.output_sizes):
            return None
        if loaded.shape[dim] != mlp.original * len(self.output_sizes):
            return None
        return list(enumerate(loaded.split(mlp.original, dim=dim)))

    def _spyre_pad(self, param: Any, loaded: torch.Tensor, shard_id: Any) -> torch.Tensor:
        dim = getattr(param, "output_dim", None)
        if (
            dim is None
            or not isinstance(shard_id, int)
            or getattr(param, "is_sharded_weight", False)
        ):
            return loaded
        out = pad_mlp_output(loaded, dim, self.output_sizes[shard_id], self._spyre_plan)
        if _padded(loaded, out):
            _require_unquantized(self, "the MLP width")
        return out


@spyre_oot(QKVParallelLinear)
class SpyreQKVParallelLinear(_ShardPaddingLoaders, QKVParallelLinear):
    """Fused QKV projection; the model's own ``qkv.split(...)`` slices its output."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # A gathered QKV output would be the full (all-rank) projection, which
        # the per-rank attention split cannot consume; upstream never asks for
        # it, and the plugin relies on that.
        assert not self.gather_output, "SpyreQKVParallelLinear requires gather_output=False"
        self._spyre_head_pad = self._find_head_pad()
        install_transposed_method(self)
        if self._spyre_head_pad is not None:
            # Built at the padded head size: a packed quantized checkpoint at
            # the original size could never load into it.
            _require_unquantized(self, "the head dimension")

    def _find_head_pad(self) -> DimPad | None:
        plan = current_plan()
        pad = plan.head_dim if plan is not None else None
        if pad is None or pad.padded == pad.original or self.head_size != pad.padded:
            return None
        if self.v_head_size != self.head_size:
            raise NotImplementedError(
                f"{self.prefix}: head-dim stick padding with a separate value head size "
                f"({self.v_head_size}) is not implemented."
            )
        return pad

    def _spyre_heads(self, shard_id: str) -> int:
        return self.total_num_heads if shard_id == "q" else self.total_num_kv_heads

    def _spyre_fused_parts(
        self, param: Any, loaded: torch.Tensor, shard_id: Any
    ) -> list[tuple[str, torch.Tensor]] | None:
        """An on-disk fused qkv at the original head size, split per shard (else None)."""
        pad, dim = self._spyre_head_pad, getattr(param, "output_dim", None)
        if shard_id is not None or pad is None or dim is None:
            return None
        sizes = [self._spyre_heads(sid) * pad.original for sid in "qkv"]
        if loaded.shape[dim] != sum(sizes):
            return None
        return list(zip("qkv", loaded.split(sizes, dim=dim), strict=True))

    def _spyre_pad(self, param: Any, loaded: torch.Tensor, shard_id: Any) -> torch.Tensor:
        dim = getattr(param, "output_dim", None)
        if dim is None or shard_id not in ("q", "k", "v"):
            return loaded
        if getattr(param, "is_sharded_weight", False):
            return loaded
        out = pad_qkv_shard(loaded, dim, self._spyre_heads(shard_id), self._spyre_head_pad)
        if _padded(loaded, out):
            _require_unquantized(self, "the head dimension")
        return out


@spyre_oot(RowParallelLinear)
class SpyreRowParallelLinear(RowParallelLinear):
    """``RowParallelLinear`` (o_proj, down_proj); upstream's TP all-reduce is kept.

    With stick padding its input columns are widened: per head for an O
    projection, at the tail for a down projection (the checkpoint tensor's
    width tells which).
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._spyre_plan: StickPadPlan | None = current_plan()
        install_transposed_method(self)

    def _spyre_pad(self, param: Any, loaded: torch.Tensor) -> torch.Tensor:
        dim = getattr(param, "input_dim", None)
        if dim is None or getattr(param, "is_sharded_weight", False):
            return loaded
        out = pad_row_input(loaded, dim, self.input_size, self._spyre_plan, self.prefix)
        if _padded(loaded, out):
            _require_unquantized(self, "the input width")
        return out

    def weight_loader(self, param: torch.nn.Parameter, loaded_weight: torch.Tensor) -> None:
        super().weight_loader(param, self._spyre_pad(param, loaded_weight))

    def weight_loader_v2(self, param: Any, loaded_weight: torch.Tensor) -> None:
        super().weight_loader_v2(param, self._spyre_pad(param, loaded_weight))


__all__ = [
    "SpyreColumnParallelLinear",
    "SpyreMergedColumnParallelLinear",
    "SpyreQKVParallelLinear",
    "SpyreReplicatedLinear",
    "SpyreRowParallelLinear",
]
