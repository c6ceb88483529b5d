"""Fixtures of the ops package's tests.

vLLM layers read the current ``VllmConfig`` and the tensor-parallel group when
they are constructed, so every layer test runs inside a real single-rank
distributed environment (gloo on the host, as vLLM's own tests set it up with
``init_distributed_environment`` + ``initialize_model_parallel``) and under
``set_current_vllm_config``. The layer swaps are registered once per session
through the package's real entry point, ``register_ops``.
"""

from __future__ import annotations

import contextlib
import os
import tempfile

import pytest


@pytest.fixture(scope="session")
def vllm_env():
    """A default VllmConfig made current, a 1-rank gloo group, swaps registered."""
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.distributed import (
        destroy_distributed_environment,
        destroy_model_parallel,
        init_distributed_environment,
        initialize_model_parallel,
    )

    from spyre_inference.ops import register_ops

    register_ops()
    config = VllmConfig()
    fd, store = tempfile.mkstemp(prefix="spyre-ops-dist-")
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
            # Not cleanup_dist_env_and_memory(): it empties the accelerator
            # cache, which raises on a host without one.
            destroy_model_parallel()
            destroy_distributed_environment()
    finally:
        with contextlib.suppress(OSError):
            os.unlink(store)


@pytest.fixture
def make_llm(make_llm, monkeypatch):
    """The testing plugin's ``make_llm``, with ``VLLM_PLUGINS`` limited to the platform
    and this package's plugin, so these tests see exactly what an install of the core
    and the ops package gives (the attention backend is found through the core's own
    entry points)."""
    monkeypatch.setenv("VLLM_PLUGINS", "spyre,spyre_ops")
    return make_llm
