"""Test helpers shared by every spyre-inference package: tiny models, prompts, references.

A distribution of its own (``spyre-inference-testing``), installed by each
package's ``test`` extra, so that no serving wheel carries test code. Its pytest
fixtures (:mod:`spyre_inference.testing.fixtures`) are a ``pytest11`` plugin:
pytest loads them in every session of an environment that has this installed.

Heavy imports (transformers, tokenizers) happen inside the functions, so
importing this package is cheap.
"""

from spyre_inference.testing.hf import (
    GreedyResult,
    assert_greedy_close,
    assert_greedy_top_k_close,
    hf_cross_encoder_scores,
    hf_greedy,
    hf_greedy_with_logprobs,
    hf_input_embeddings,
    vllm_greedy_with_top_logprobs,
)
from spyre_inference.testing.inproc import (
    compiled_graphs,
    inductor_calls,
    runner_of,
    scheduler_of,
)
from spyre_inference.testing.layer_env import single_rank_vllm
from spyre_inference.testing.models import (
    DEFAULT_DTYPE,
    KINDS,
    build_tiny_model,
    tiny_config,
)
from spyre_inference.testing.prompts import TEST_PROMPTS
from spyre_inference.testing.tokenizer import (
    BOS_TOKEN_ID,
    CHAT_TEMPLATE,
    EOS_TOKEN_ID,
    PAD_TOKEN_ID,
    VOCAB_SIZE,
    build_tokenizer,
    save_tokenizer,
)

__all__ = [
    "BOS_TOKEN_ID",
    "CHAT_TEMPLATE",
    "DEFAULT_DTYPE",
    "EOS_TOKEN_ID",
    "KINDS",
    "PAD_TOKEN_ID",
    "TEST_PROMPTS",
    "VOCAB_SIZE",
    "GreedyResult",
    "assert_greedy_close",
    "assert_greedy_top_k_close",
    "build_tiny_model",
    "build_tokenizer",
    "compiled_graphs",
    "hf_cross_encoder_scores",
    "hf_greedy",
    "hf_greedy_with_logprobs",
    "hf_input_embeddings",
    "inductor_calls",
    "runner_of",
    "save_tokenizer",
    "scheduler_of",
    "single_rank_vllm",
    "tiny_config",
    "vllm_greedy_with_top_logprobs",
]
