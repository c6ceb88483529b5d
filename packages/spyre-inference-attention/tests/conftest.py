"""Fixtures of the attention package's tests.

The builder and impl are driven the way vLLM drives them, so they need a real
``VllmConfig``: it is built from a tiny Llama config written to a temporary
directory (no weights, no tokenizer, nothing fetched), and goes through the
installed platform's ``check_and_update_config`` like any engine start.
"""

from __future__ import annotations

import pytest

#: The configuration every backend test runs under. Small enough that a whole
#: prefill bucket (64 rows) and the longest context (2048 tokens, 32 pages)
#: stay in milliseconds on two cores.
MAX_MODEL_LEN = 2048
MAX_NUM_BATCHED_TOKENS = 64
BLOCK_SIZE = 64


def _make_config(tmp_path_factory, *, enforce_eager: bool, **scheduler):
    from transformers import LlamaConfig
    from vllm.config import CacheConfig, ModelConfig, SchedulerConfig, VllmConfig

    model_dir = tmp_path_factory.mktemp("tiny-llama")
    # head_dim 64, a whole stick: the platform's stick-padding plan then leaves
    # the config alone, so impls built under it keep the scale a test passes
    # whatever head size the test uses (the kernels take any).
    LlamaConfig(
        hidden_size=256,
        intermediate_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        num_hidden_layers=1,
        vocab_size=256,
        max_position_embeddings=MAX_MODEL_LEN,
    ).save_pretrained(model_dir)
    model_config = ModelConfig(
        model=str(model_dir),
        dtype="float32",
        max_model_len=MAX_MODEL_LEN,
        skip_tokenizer_init=True,
        enforce_eager=enforce_eager,
    )
    scheduler_config = SchedulerConfig(
        max_num_batched_tokens=MAX_NUM_BATCHED_TOKENS,
        max_num_seqs=scheduler.get("max_num_seqs", 16),
        max_model_len=MAX_MODEL_LEN,
        is_encoder_decoder=False,
    )
    return VllmConfig(
        model_config=model_config,
        scheduler_config=scheduler_config,
        cache_config=CacheConfig(block_size=BLOCK_SIZE),
    )


@pytest.fixture(scope="session")
def vllm_config(tmp_path_factory):
    """``--enforce-eager``: the token-major kernels run eagerly (the correctness matrix)."""
    return _make_config(tmp_path_factory, enforce_eager=True)


@pytest.fixture(scope="session")
def compiled_vllm_config(tmp_path_factory):
    """The model compiles: every attention kernel is an Inductor graph per bucket."""
    return _make_config(tmp_path_factory, enforce_eager=False)


@pytest.fixture(autouse=True)
def _fresh_settings():
    """Re-parse plugin settings after every test (tests change the environment).

    Autouse fixtures are set up before ``monkeypatch`` and torn down after it
    has restored the environment, so the cache never outlives a test's values.
    """
    from spyre_inference.platform import settings

    settings.reset_cache()
    yield
    settings.reset_cache()
