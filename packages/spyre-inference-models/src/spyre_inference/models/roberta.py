"""RoBERTa / XLM-RoBERTa: token types from the embedding's side buffer.

As for BERT (:mod:`spyre_inference.models.bert`): the wrappers name
:class:`SpyreRobertaEmbedding` as their ``embedding_class`` and stage
``token_type_ids`` into its side buffer. RoBERTa's positions start at
``padding_idx + 1``; the embedding adds that offset without touching the
runner's position buffer, as upstream does.
"""

from __future__ import annotations

from transformers import RobertaConfig
from vllm.model_executor.models.roberta import (
    RobertaEmbedding,
    RobertaEmbeddingModel,
    RobertaForSequenceClassification,
    RobertaForTokenClassification,
)

from spyre_inference.models._token_type import StagesTokenTypes, TokenTypeSideBuffer


class SpyreRobertaEmbedding(TokenTypeSideBuffer, RobertaEmbedding):
    """``RobertaEmbedding`` reading token types from its side buffer."""

    def __init__(self, config: RobertaConfig) -> None:
        super().__init__(config)
        self._init_token_type_buffer()
        # Positions start at padding_idx + 1; the runner's buffer is left alone.
        self.spyre_position_offset = self.padding_idx + 1


class SpyreRobertaEmbeddingModel(StagesTokenTypes, RobertaEmbeddingModel):
    """``RobertaEmbeddingModel`` (``RobertaModel``, ``XLMRobertaModel``, ...)."""

    BACKBONE = "model"
    embedding_class = SpyreRobertaEmbedding


class SpyreRobertaForSequenceClassification(StagesTokenTypes, RobertaForSequenceClassification):
    """Cross-encoder RoBERTa with side-buffer token types."""

    BACKBONE = "roberta"
    embedding_class = SpyreRobertaEmbedding


class SpyreRobertaForTokenClassification(StagesTokenTypes, RobertaForTokenClassification):
    """Token-classification RoBERTa with side-buffer token types."""

    BACKBONE = "roberta"
    embedding_class = SpyreRobertaEmbedding


__all__ = [
    "SpyreRobertaEmbedding",
    "SpyreRobertaEmbeddingModel",
    "SpyreRobertaForSequenceClassification",
    "SpyreRobertaForTokenClassification",
]
