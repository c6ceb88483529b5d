"""The call boundary between the runner (host) and the model (device).

Spec: "_SpyreModelWrapper sits between the model runner and the model and
converts at the call boundary". It is invoked from the runner's
``_model_forward`` (vLLM's documented override point) rather than installed
as ``runner.model``: vLLM inspects ``runner.model`` with ``isinstance`` for
model capabilities (pooling, multimodal, MoE), which a wrapper would hide.

* input: host int32/int64 token ids and positions -> device int64 (the
  embedding and RoPE gathers index with them);
* output: device hidden states -> host (logits indexing and sampling run on
  the host).

On the cpu target both conversions are identity operations.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from spyre_inference.platform import device as dev


class _SpyreModelWrapper:
    def __init__(self, model: nn.Module) -> None:
        self.model = model

    def __call__(
        self,
        input_ids: torch.Tensor | None = None,
        positions: torch.Tensor | None = None,
        **kwargs: Any,
    ) -> Any:
        if input_ids is not None:
            input_ids = _index_to_device(input_ids)
        if positions is not None:
            positions = _index_to_device(positions)
        out = self.model(input_ids=input_ids, positions=positions, **kwargs)
        if isinstance(out, torch.Tensor):
            return dev.to_host(out)
        return out


def _index_to_device(t: torch.Tensor) -> torch.Tensor:
    if not dev.is_spyre():
        # The host embedding takes the runner's int32 ids as they are; the
        # card's copy is still counted (a cost proxy).
        dev.note_transfer("h2d")
        return t
    return dev.to_device(t, dtype=torch.int64)
