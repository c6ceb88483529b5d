"""Fixtures of the models package's tests.

Tiny models come from the core's shared fixtures (built once per session);
``make_llm`` builds ``vllm.LLM`` engines and shuts their engine processes down
after each test. ``LLM.apply_model`` ships a function to the engine process
with cloudpickle, which vLLM only allows with
VLLM_ALLOW_INSECURE_SERIALIZATION=1 (tests only).
"""

from __future__ import annotations

import contextlib
import gc
import os
import tempfile
from collections.abc import Iterator
from typing import Any

import pytest


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


@pytest.fixture(scope="session")
def vllm_env() -> Iterator[Any]:
    """A default VllmConfig made current and a 1-rank gloo group, for layer tests.

    vLLM layers read the current config and the tensor-parallel group when
    they are constructed; this is how vLLM's own layer tests set them up.
    """
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.distributed import (
        destroy_distributed_environment,
        destroy_model_parallel,
        init_distributed_environment,
        initialize_model_parallel,
    )

    config = VllmConfig()
    fd, store = tempfile.mkstemp(prefix="spyre-models-dist-")
    os.close(fd)
    try:
        with set_current_vllm_config(config):
            init_distributed_environment(
                world_size=1,
                rank=0,
                distributed_init_method=f"file://{store}",
                local_rank=0,
                backend="gloo",
            )
            initialize_model_parallel(1, 1)
            yield config
            destroy_model_parallel()
            destroy_distributed_environment()
    finally:
        with contextlib.suppress(OSError):
            os.unlink(store)
