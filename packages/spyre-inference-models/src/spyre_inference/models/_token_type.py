"""token_type_ids in a side buffer owned by the embedding (BERT / RoBERTa).

Upstream vLLM carries a cross-encoder's token types to the embedding by
bit-packing them into ``input_ids`` (``input_ids | type << 30``) and unpacking
them in the embedding with ``&``, ``>>`` and an in-place ``&=`` on the ids:
integer bit arithmetic on the device, which Spyre cannot run
(torch-spyre#3509), and a mutation of the runner's persistent input buffer.

Here the embedding owns a persistent ``int64`` buffer ``spyre_token_type_ids``
of ``max_num_batched_tokens`` rows (a buffer, so it follows the model to the
device). The model's ``forward`` receives ``token_type_ids`` from vLLM's runner
as an ordinary keyword, writes them into the buffer before running the
encoder (:meth:`TokenTypeSideBuffer.stage_token_type_ids`) and the embedding
reads the step's rows back with a slice; the ids are used only as the index of
the ``token_type_embeddings`` gather, exactly like the word ids. Rows beyond a
step's tokens are kept zero (type 0), which is what a request without token
types means. The buffer is a persistent tensor for the same reason upstream
chose the bit-pack: everything a compiled module reads must be.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch
from torch import nn

from spyre_inference.platform import device as dev

BUFFER_NAME = "spyre_token_type_ids"


def _max_tokens() -> int:
    from vllm.config import get_current_vllm_config

    config = get_current_vllm_config()
    return int(config.scheduler_config.max_num_batched_tokens)


class TokenTypeSideBuffer(nn.Module):
    """Mixin for an embedding module: the per-step token types, in a buffer of its own."""

    spyre_token_type_ids: torch.Tensor

    def _init_token_type_buffer(self, rows: int | None = None) -> None:
        rows = _max_tokens() if rows is None else rows
        self.register_buffer(BUFFER_NAME, torch.zeros(rows, dtype=torch.int64), persistent=False)
        # Rows [0, _spyre_nonzero_rows) may hold a previous step's types.
        self._spyre_nonzero_rows = 0

    def stage_token_type_ids(self, token_type_ids: torch.Tensor | None) -> None:
        """Make the buffer hold this step's token types (``None``: all type 0)."""
        buf = self.spyre_token_type_ids
        count = 0 if token_type_ids is None else int(token_type_ids.shape[0])
        if count > buf.shape[0]:
            raise ValueError(
                f"{count} token types for a step, but the side buffer holds "
                f"{buf.shape[0]} (max_num_batched_tokens)."
            )
        if token_type_ids is not None:
            buf[:count].copy_(dev.to_device(token_type_ids, torch.int64))
        if self._spyre_nonzero_rows > count:
            buf[count : self._spyre_nonzero_rows].zero_()
        self._spyre_nonzero_rows = count

    def token_type_ids_for(self, num_tokens: int) -> torch.Tensor:
        """This step's token types (the first ``num_tokens`` rows of the buffer)."""
        return self.spyre_token_type_ids[:num_tokens]

    #: Added to the runner's positions (RoBERTa's start at ``padding_idx + 1``).
    spyre_position_offset: int = 0

    def forward(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        inputs_embeds: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Upstream's BERT-family embedding sum, with token types from the side buffer."""
        if inputs_embeds is None:
            inputs_embeds = self.word_embeddings(input_ids)
        if self.spyre_position_offset:
            position_ids = position_ids + self.spyre_position_offset
        token_type_ids = self.token_type_ids_for(inputs_embeds.shape[0])
        embeddings = (
            inputs_embeds
            + self.token_type_embeddings(token_type_ids)
            + self.position_embeddings(position_ids)
        )
        return self.LayerNorm(embeddings)


def stage_token_types(embeddings: nn.Module, token_type_ids: torch.Tensor | None) -> None:
    """Stage ``token_type_ids`` into ``embeddings`` if it is a side-buffer embedding.

    An embedding without the side buffer (e.g. the rotary Jina-style RoBERTa
    built by the same upstream wrapper) only accepts a step without token types.
    """
    if isinstance(embeddings, TokenTypeSideBuffer):
        embeddings.stage_token_type_ids(token_type_ids)
    elif token_type_ids is not None:
        raise NotImplementedError(
            f"{type(embeddings).__name__} has no token-type side buffer; spyre-inference "
            "cannot pass token_type_ids to it."
        )


class StagesTokenTypes:
    """Mixin for an upstream BERT-family wrapper: ``token_type_ids`` go to the side buffer.

    ``BACKBONE`` names the wrapper's ``BertModel`` attribute. The upstream
    ``forward`` then runs with no token types, so it never bit-packs.
    """

    BACKBONE: ClassVar[str]

    def forward(
        self,
        input_ids: torch.Tensor | None,
        positions: torch.Tensor,
        intermediate_tensors: Any = None,
        inputs_embeds: torch.Tensor | None = None,
        token_type_ids: torch.Tensor | None = None,
    ) -> Any:
        backbone = getattr(self, self.BACKBONE)
        stage_token_types(backbone.embeddings, token_type_ids)
        return super().forward(  # type: ignore[misc]
            input_ids=input_ids,
            positions=positions,
            intermediate_tensors=intermediate_tensors,
            inputs_embeds=inputs_embeds,
        )


__all__ = ["BUFFER_NAME", "StagesTokenTypes", "TokenTypeSideBuffer", "stage_token_types"]
