"""BERT: token types from the embedding's side buffer instead of bit-packed ids.

Every upstream BERT wrapper builds its encoder with ``embedding_class`` (a
class attribute vLLM 0.33 reads in ``__init__``), so the Spyre wrappers only
name :class:`SpyreBertEmbedding` there; no built instance needs retyping. Their
``forward`` stages ``token_type_ids`` into the embedding's side buffer
(:mod:`spyre_inference.models._token_type`) and runs upstream's forward without
them. :class:`SpyreBertEmbeddingModel` (architecture ``BertModel``, the
sentence-embedding path of ``LLM.embed`` and ``/v1/embeddings``) also accepts
token types, which upstream's embedding model does not.
"""

from __future__ import annotations

from transformers import BertConfig
from vllm.model_executor.models.bert import (
    BertEmbedding,
    BertEmbeddingModel,
    BertForSequenceClassification,
    BertForTokenClassification,
)

from spyre_inference.models._token_type import StagesTokenTypes, TokenTypeSideBuffer


class SpyreBertEmbedding(TokenTypeSideBuffer, BertEmbedding):
    """``BertEmbedding`` reading token types from its side buffer."""

    def __init__(self, config: BertConfig) -> None:
        super().__init__(config)
        self._init_token_type_buffer()


class SpyreBertEmbeddingModel(StagesTokenTypes, BertEmbeddingModel):
    """``BertEmbeddingModel`` (architecture ``BertModel``) with side-buffer token types."""

    BACKBONE = "model"
    embedding_class = SpyreBertEmbedding


class SpyreBertForSequenceClassification(StagesTokenTypes, BertForSequenceClassification):
    """Cross-encoder BERT: query/document token types through the side buffer."""

    BACKBONE = "bert"
    embedding_class = SpyreBertEmbedding


class SpyreBertForTokenClassification(StagesTokenTypes, BertForTokenClassification):
    """Token-classification BERT with side-buffer token types."""

    BACKBONE = "bert"
    embedding_class = SpyreBertEmbedding


__all__ = [
    "SpyreBertEmbedding",
    "SpyreBertEmbeddingModel",
    "SpyreBertForSequenceClassification",
    "SpyreBertForTokenClassification",
]
