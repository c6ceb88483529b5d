"""The vocabulary matrix in INT8 on the cpu target (``SPYRE_CPU_INT8_VOCAB=1``).

The ``[vocab, hidden]`` matrix is a small model's largest weight (SmolLM2-135M:
28 M of 135 M parameters) and the largest single read of a decode step (the LM
head). vLLM's quantized checkpoints leave it in 16 bits: compressed-tensors has
no quantized embedding or head method, and vLLM's ``quant_config`` for them is
the unquantized one. With this setting the plugin quantizes it at load,
symmetric INT8 with a float32 scale per vocabulary row (what llama.cpp's Q8_0
does per block), in the spec's ``[in, out]`` layout (``[hidden, vocab]``, rows
padded to the LM head's 64x32 alignment):

* the LM head (:class:`SpyreInt8LMHeadMethod`) quantizes each token's hidden
  state per token and computes the exact INT8 product (``host_int8.int8_mm``, int32
  accumulation), then applies both scales in float32: float32 logits;
* the input embedding (:class:`SpyreInt8EmbeddingMethod`) gathers the token's
  column and scales it back to the model dtype.

A tied embedding and head share one table: it is kept on the shared weight
parameter (:func:`int8_vocab`), made by whichever module is processed first,
and the 16-bit matrix is released once made. Each module registers the table's
tensors as its own parameters, so the model's parameter count (and the memory
plan) sees them, once.

cpu target only: the card computes in float16, and the spec allows no integer
tensors on the device. LoRA (which reads the head's 16-bit weight) is refused
with it at start-up (:mod:`spyre_inference.ops.quantization_checks`); in-place
weight reloading is not supported (the 16-bit matrix is gone).
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from torch.nn import Parameter
from vllm.model_executor.layers.vocab_parallel_embedding import UnquantizedEmbeddingMethod

from spyre_inference.ops import host_int8
from spyre_inference.ops.host_int8 import int8_mm
from spyre_inference.ops.quantized_linear import INT8_MAX, quantize_per_token
from spyre_inference.ops.unused_stage import is_unused_stage
from spyre_inference.platform import settings
from spyre_inference.platform.device import STICK_ELEMS, is_spyre, round_up

#: Vocabulary rows are padded to whole sticks across Spyre's 32 cores (as the
#: 16-bit LM head's; ``lm_head.LM_HEAD_ROW_ALIGN``).
ROW_ALIGN = STICK_ELEMS * 32
#: Where a vocabulary weight parameter keeps its INT8 table.
TABLE_ATTR = "spyre_int8_vocab"
#: The table's tensors, registered on each module that uses it.
WEIGHT_T_PARAM = "int8_weight_t"
SCALE_PARAM = "int8_row_scale"

RELOAD_UNSUPPORTED = (
    "SPYRE_CPU_INT8_VOCAB=1 keeps the vocabulary matrix only in INT8, so the weights "
    "cannot be reloaded in place; unset SPYRE_CPU_INT8_VOCAB to reload weights."
)


def enabled() -> bool:
    """Whether vocabulary matrices are INT8 in this process (the cpu target only)."""
    return bool(settings.get("SPYRE_CPU_INT8_VOCAB")) and not is_spyre()


@dataclasses.dataclass(frozen=True)
class Int8Vocab:
    """One vocabulary matrix in INT8: ``weight_t`` ``[hidden, rows_padded]`` int8,
    ``scale`` ``[rows_padded]`` float32, ``rows`` before padding."""

    weight_t: Parameter
    scale: Parameter
    rows: int


@torch.no_grad()
def quantize_vocab(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``[rows, hidden]`` -> (``[hidden, rows_padded]`` int8, ``[rows_padded]`` float32).

    Symmetric per row; pad rows are zero with scale 1 (their logits are
    sliced off).
    """
    q, scale = quantize_per_token(weight, INT8_MAX, torch.int8)
    rows = weight.shape[0]
    padded = round_up(rows, ROW_ALIGN)
    if padded != rows:
        q = F.pad(q, (0, 0, 0, padded - rows))
        scale = F.pad(scale, (0, 0, 0, padded - rows), value=1.0)
    return q.t().contiguous(), scale.reshape(-1).contiguous()


def int8_vocab(weight: Parameter) -> Int8Vocab:
    """The INT8 table of a vocabulary weight, made on first call and kept on it.

    The 16-bit values are released once the table exists: every module that
    holds this parameter (a tied embedding and head) reads the table instead.
    """
    table = getattr(weight, TABLE_ATTR, None)
    if table is None:
        host_int8.dispatch()
        q_t, scale = quantize_vocab(weight.data)
        table = Int8Vocab(
            Parameter(q_t, requires_grad=False),
            Parameter(scale, requires_grad=False),
            weight.shape[0],
        )
        setattr(weight, TABLE_ATTR, table)
        weight.data = torch.empty(0, dtype=weight.dtype, device=weight.device)
    return table


def _register(layer: torch.nn.Module, table: Int8Vocab) -> None:
    layer.register_parameter(WEIGHT_T_PARAM, table.weight_t)
    layer.register_parameter(SCALE_PARAM, table.scale)


class SpyreInt8EmbeddingMethod(UnquantizedEmbeddingMethod):
    """The input embedding gathers INT8 columns and scales them back."""

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        _register(layer, int8_vocab(layer.weight))

    def embedding(self, layer: torch.nn.Module, input_: torch.Tensor) -> torch.Tensor:
        ids = input_.reshape(-1)
        weight_t = getattr(layer, WEIGHT_T_PARAM)
        scale = getattr(layer, SCALE_PARAM)
        rows = weight_t.index_select(1, ids).t().to(torch.float32)
        out = (rows * scale.index_select(0, ids).unsqueeze(-1)).to(layer.params_dtype)
        return out.view(*input_.shape, weight_t.shape[0])


def int8_logits(
    layer: torch.nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """``x @ W.T`` over the layer's INT8 table: float32 logits ``[..., rows]``."""
    weight_t = getattr(layer, WEIGHT_T_PARAM)
    scale = getattr(layer, SCALE_PARAM)
    x2 = x.reshape(-1, x.shape[-1])
    xq, x_scale = quantize_per_token(x2, INT8_MAX, torch.int8)
    acc = int8_mm(xq, weight_t)
    out = acc.to(torch.float32) * x_scale * scale
    rows = layer.spyre_vocab_rows
    if rows != out.shape[-1]:
        out = out[:, :rows]
    if bias is not None:
        out = out + bias.to(torch.float32)
    return out.view(*x.shape[:-1], rows)


class SpyreInt8LMHeadMethod(UnquantizedEmbeddingMethod):
    """The LM head as an INT8 GEMM over the (possibly shared) INT8 table."""

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        if is_unused_stage(layer):
            return
        table = int8_vocab(layer.weight)
        # The head's reference to the (released) 16-bit parameter goes; a tied
        # embedding keeps its own.
        del layer.weight
        _register(layer, table)
        layer.spyre_vocab_rows = table.rows

    def apply(
        self, layer: torch.nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        return int8_logits(layer, x, bias)

    def refresh_after_weight_update(self, layer: torch.nn.Module) -> None:
        raise RuntimeError(RELOAD_UNSUPPORTED)


__all__ = [
    "Int8Vocab",
    "SpyreInt8EmbeddingMethod",
    "SpyreInt8LMHeadMethod",
    "enabled",
    "int8_logits",
    "int8_vocab",
    "quantize_vocab",
]
