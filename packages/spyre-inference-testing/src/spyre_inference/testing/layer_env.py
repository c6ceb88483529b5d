"""A single-rank vLLM environment for tests that build vLLM layers outside an engine.

vLLM layers read the current ``VllmConfig`` and the tensor-parallel group when
they are constructed, so a layer test runs inside a real one-rank distributed
environment (gloo on the host) under ``set_current_vllm_config``, set up the way
vLLM's own layer tests do (``init_distributed_environment`` +
``initialize_model_parallel``). The packages' ``vllm_env`` fixtures wrap this.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Iterator
from typing import Any


@contextlib.contextmanager
def single_rank_vllm(store_prefix: str = "spyre-dist-") -> Iterator[Any]:
    """A default ``VllmConfig`` made current and a 1-rank gloo group; yields the config.

    The group rendezvous through a temporary file named with ``store_prefix``
    (removed afterwards).
    """
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.distributed import (
        destroy_distributed_environment,
        destroy_model_parallel,
        init_distributed_environment,
        initialize_model_parallel,
    )

    config = VllmConfig()
    fd, store = tempfile.mkstemp(prefix=store_prefix)
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


__all__ = ["single_rank_vllm"]
