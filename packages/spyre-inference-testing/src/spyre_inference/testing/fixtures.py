"""The pytest plugin (entry point ``pytest11: spyre_inference``): tiny random models.

pytest loads this module in every session of an environment where
``spyre-inference-testing`` is installed; no conftest imports it.

Every fixture returns the :class:`~pathlib.Path` of a model folder that vLLM
(``LLM(model=str(path))``) and transformers both load. Models live under the
session's pytest base temp dir (``<basetemp>/tiny-models/``) and are built the
first time a test asks for them, in about a second each after the first
(transformers' import dominates). The cache is per process, not per fixture
definition, so a model is never built twice in one process.
"""

from __future__ import annotations

import gc
import hashlib
import json
import os
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from spyre_inference.testing.hf import (
    GreedyResult,
    assert_greedy_close,
    hf_greedy,
    hf_greedy_with_logprobs,
)
from spyre_inference.testing.models import build_tiny_model
from spyre_inference.testing.prompts import TEST_PROMPTS

_built: dict[str, Path] = {}
_lock = threading.Lock()

TinyModelFactory = Callable[..., Path]

#: The num_tokens buckets of every test engine whose test (or environment) names
#: none, set for the whole pytest session. Warm-up runs each bucket once per block
#: variant, each a Dynamo trace plus an Inductor compile or cache load (~0.5 s warm,
#: seconds cold, on a 2-core AVX2 host); the cpu target's default for a 128-token
#: budget is 8 buckets (1, 2, 4, ..., 128), 15 for vLLM's 2048. These keep the paths
#: a test exercises (one-row decode through the host kernels, a padded small batch,
#: prefill chunks) with at most 8x padding, and the budget is always added
#: (``TokenBuckets``). Tests of the default set unset it (``monkeypatch.delenv``, or
#: ``inproc_llm`` without ``buckets``).
TEST_NUM_TOKENS_BUCKETS = "1,8,64,512"


def _cache_key(kind: str, overrides: dict[str, Any]) -> str:
    if not overrides:
        return kind
    encoded = json.dumps(overrides, sort_keys=True, default=str)
    return f"{kind}-{hashlib.sha256(encoded.encode()).hexdigest()[:12]}"


def get_tiny_model(base_dir: Path, kind: str, **overrides: Any) -> Path:
    """Build (or reuse, within this process) a tiny model under ``base_dir``."""
    key = _cache_key(kind, overrides)
    with _lock:
        path = _built.get(key)
        if path is None or not path.exists():
            path = build_tiny_model(kind, base_dir / key, **overrides)
            _built[key] = path
        return path


@pytest.fixture(scope="session")
def tiny_model_factory(tmp_path_factory: pytest.TempPathFactory) -> TinyModelFactory:
    """``tiny_model_factory(kind, **overrides) -> Path``, cached per arguments.

    Overrides are those of :func:`build_tiny_model`, e.g.
    ``tiny_model_factory("llama", head_dim=32, num_hidden_layers=3)``.
    """
    base_dir = tmp_path_factory.getbasetemp() / "tiny-models"
    base_dir.mkdir(exist_ok=True)

    def factory(kind: str, **overrides: Any) -> Path:
        return get_tiny_model(base_dir, kind, **overrides)

    return factory


@pytest.fixture(scope="session")
def tiny_llama(tiny_model_factory: TinyModelFactory) -> Path:
    """Llama: 2 layers, hidden 256, 4 heads / 2 KV heads, head_dim 64, rope theta 5e5."""
    return tiny_model_factory("llama")


@pytest.fixture(scope="session")
def tiny_granite(tiny_model_factory: TinyModelFactory) -> Path:
    """Granite with embedding/residual/attention multipliers and logits scaling != 1."""
    return tiny_model_factory("granite")


@pytest.fixture(scope="session")
def tiny_qwen3(tiny_model_factory: TinyModelFactory) -> Path:
    """Qwen3 (per-head q/k RMSNorm), rope theta 1e6."""
    return tiny_model_factory("qwen3")


@pytest.fixture(scope="session")
def tiny_gemma3(tiny_model_factory: TinyModelFactory) -> Path:
    """Gemma 3 text: sliding window 48 on even layers, query_pre_attn_scalar 32, tied."""
    return tiny_model_factory("gemma3")


@pytest.fixture(scope="session")
def tiny_mixtral(tiny_model_factory: TinyModelFactory) -> Path:
    """Mixtral MoE: 4 experts, top-2."""
    return tiny_model_factory("mixtral")


@pytest.fixture(scope="session")
def tiny_qwen3_moe(tiny_model_factory: TinyModelFactory) -> Path:
    """Qwen3-MoE: 4 experts of intermediate 256, top-2 with renormalised weights."""
    return tiny_model_factory("qwen3_moe")


@pytest.fixture(scope="session")
def tiny_bert(tiny_model_factory: TinyModelFactory) -> Path:
    """BertModel (embedding), type_vocab_size 2; encoder-style tokenizer."""
    return tiny_model_factory("bert")


@pytest.fixture(scope="session")
def tiny_roberta(tiny_model_factory: TinyModelFactory) -> Path:
    """RobertaModel (embedding), type_vocab_size 2, max_position_embeddings 1026."""
    return tiny_model_factory("roberta")


@pytest.fixture(scope="session")
def tiny_prompts() -> tuple[str, ...]:
    """The fixed prompts of :mod:`spyre_inference.testing.prompts`."""
    return TEST_PROMPTS


__all__ = [
    "GreedyResult",
    "assert_greedy_close",
    "get_tiny_model",
    "hf_greedy",
    "hf_greedy_with_logprobs",
    "inproc_llm",
    "llm_defaults",
    "llm_in_process",
    "make_llm",
    "pytest_collection_modifyitems",
    "pytest_configure",
    "tiny_bert",
    "tiny_gemma3",
    "tiny_granite",
    "tiny_llama",
    "tiny_mixtral",
    "tiny_model_factory",
    "tiny_prompts",
    "tiny_qwen3",
    "tiny_qwen3_moe",
    "tiny_roberta",
]


@pytest.fixture
def llm_defaults() -> dict[str, Any]:
    """``LLM(...)`` arguments :func:`make_llm` fills in; a conftest overrides it to change them."""
    return {"max_model_len": 512, "max_num_seqs": 8, "max_num_batched_tokens": 128}


@pytest.fixture
def llm_in_process() -> bool:
    """Whether :func:`make_llm` runs its engines in the test's process; a conftest
    overrides it. False here: vLLM's default engine process, as users run it."""
    return False


@pytest.fixture
def make_llm(
    monkeypatch: pytest.MonkeyPatch, llm_defaults: dict[str, Any], llm_in_process: bool
) -> Iterator[Any]:
    """``make_llm(model, **llm_kwargs)``: ``vllm.LLM`` engines, shut down after the test.

    Each engine core runs in its own process, as vLLM defaults, unless
    ``llm_in_process`` says otherwise: then in the test's process, which skips the
    engine process's start (a spawn and vLLM's import, ~15 s on a 2-core AVX2 host)
    for tests about what the engine computes rather than how it is deployed.

    ``LLM.apply_model`` ships a function to the engine process with cloudpickle,
    which vLLM allows only with VLLM_ALLOW_INSECURE_SERIALIZATION=1 (tests only).
    """
    from vllm import LLM

    monkeypatch.setenv("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
    if llm_in_process:
        monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    engines: list[Any] = []

    def factory(model: Path | str, **kwargs: Any) -> Any:
        if llm_in_process:
            _fresh_process_state()
        llm = LLM(model=str(model), **{**llm_defaults, **kwargs})
        engines.append(llm)
        return llm

    yield factory
    _shut_down(engines)
    if llm_in_process:
        _fresh_process_state()


def _fresh_process_state() -> None:
    """Forget what an earlier engine in this process cached: the plugin's settings
    (read once per process), vLLM's environment cache, Dynamo's compiled frames
    (block classes share ``forward`` code objects across models) and its counters."""
    import torch
    import vllm.envs as vllm_envs
    from torch._dynamo.utils import counters

    from spyre_inference.platform import settings

    settings.reset_cache()
    vllm_envs.disable_envs_cache()
    torch._dynamo.reset()
    counters.clear()


def _shut_down(engines: list[Any]) -> None:
    """Stop every engine a fixture made (its engine core and, if any, its process)."""
    for llm in engines:
        llm.llm_engine.engine_core.shutdown()
    engines.clear()
    gc.collect()


@pytest.fixture
def inproc_llm(monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    """``inproc_llm(model, buckets=..., granularity=..., **llm_kwargs)``: an in-process engine.

    See :mod:`spyre_inference.testing.inproc` (the runner and torch's compile
    counters are readable from the test). Defaults: float32, max_model_len
    512, 8 sequences, 64 batched tokens, block granularity, the settings'
    default buckets unless ``buckets`` names them.
    """
    from vllm import LLM

    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    engines: list[Any] = []

    def factory(
        model: Path, *, buckets: str | None = None, granularity: str = "block", **kwargs: Any
    ) -> Any:
        if buckets is None:
            monkeypatch.delenv("SPYRE_NUM_TOKENS_BUCKETS", raising=False)
        else:
            monkeypatch.setenv("SPYRE_NUM_TOKENS_BUCKETS", buckets)
        monkeypatch.setenv("SPYRE_COMPILE_GRANULARITY", granularity)
        _fresh_process_state()
        kwargs.setdefault("max_model_len", 512)
        kwargs.setdefault("max_num_seqs", 8)
        kwargs.setdefault("max_num_batched_tokens", 64)
        kwargs.setdefault("dtype", "float32")
        llm = LLM(model=str(model), **kwargs)
        engines.append(llm)
        return llm

    yield factory
    _shut_down(engines)
    _fresh_process_state()


def pytest_configure(config: pytest.Config) -> None:
    # Before any fixture starts an engine or a server (they inherit the variable).
    os.environ.setdefault("SPYRE_NUM_TOKENS_BUCKETS", TEST_NUM_TOKENS_BUCKETS)
    config.addinivalue_line(
        "markers", "spyre: needs a Spyre card (torch-spyre and a visible card); skipped without"
    )


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Tests marked ``spyre`` need a card: skip them on the cpu and emulated targets.

    Lives in the plugin so every package's tests get the same rule.
    """
    from spyre_inference.platform import device

    if device.has_card():
        return
    skip = pytest.mark.skip(
        reason=f"needs a Spyre card (running on the {device.target().value} target)"
    )
    for item in items:
        if item.get_closest_marker("spyre") is not None:
            item.add_marker(skip)
