"""Fixtures of the models package's tests.

Tiny models come from the core's shared fixtures (built once per session);
``make_llm`` builds ``vllm.LLM`` engines and shuts their engine processes down
after each test. ``LLM.apply_model`` ships a function to the engine process
with cloudpickle, which vLLM only allows with
VLLM_ALLOW_INSECURE_SERIALIZATION=1 (tests only).
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from typing import Any

import pytest

from spyre_inference.platform.testing.fixtures import *  # noqa: F403


@pytest.fixture
def make_llm(monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    from vllm import LLM

    monkeypatch.setenv("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
    engines: list[Any] = []

    def factory(model: Any, **kwargs: Any) -> LLM:
        kwargs.setdefault("max_model_len", 512)
        kwargs.setdefault("max_num_seqs", 8)
        kwargs.setdefault("max_num_batched_tokens", 128)
        llm = LLM(model=str(model), **kwargs)
        engines.append(llm)
        return llm

    yield factory
    for llm in engines:
        llm.llm_engine.engine_core.shutdown()
    engines.clear()
    gc.collect()
