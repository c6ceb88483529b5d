"""Test helpers shared by every spyre-inference package: tiny models, prompts, references.

Depends only on what the core itself depends on (vLLM, torch, and the
transformers/tokenizers that vLLM installs), so any package's tests can use it.
Heavy imports (transformers, tokenizers) happen inside the functions, so
importing this package is cheap.

Use the pytest fixtures from a package's ``tests/conftest.py``::

    from spyre_inference.platform.testing.fixtures import *  # noqa: F403

(``pytest_plugins`` is only honoured in the rootdir's conftest, so a star
import is what works for per-package test folders.)
"""

from spyre_inference.platform.testing.hf import (
    GreedyResult,
    assert_greedy_close,
    assert_greedy_top_k_close,
    hf_cross_encoder_scores,
    hf_greedy,
    hf_greedy_with_logprobs,
)
from spyre_inference.platform.testing.models import (
    DEFAULT_DTYPE,
    KINDS,
    build_tiny_model,
    tiny_config,
)
from spyre_inference.platform.testing.prompts import TEST_PROMPTS
from spyre_inference.platform.testing.tokenizer import (
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
    "hf_cross_encoder_scores",
    "hf_greedy",
    "hf_greedy_with_logprobs",
    "save_tokenizer",
    "tiny_config",
]
