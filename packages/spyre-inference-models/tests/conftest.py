"""Fixtures of the models package's tests.

Tiny models and ``make_llm`` (``vllm.LLM`` engines shut down after each test)
come from the testing distribution's pytest plugin.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Iterator
from typing import Any

import pytest


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
