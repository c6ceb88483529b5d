"""Fixtures of the ops package's tests.

vLLM layers read the current ``VllmConfig`` and the tensor-parallel group when
they are constructed, so every layer test runs inside a real single-rank
distributed environment (gloo on the host, as vLLM's own tests set it up with
``init_distributed_environment`` + ``initialize_model_parallel``) and under
``set_current_vllm_config``. The layer swaps are registered once per session
through the package's real entry point, ``register_ops``.
"""

from __future__ import annotations

import pytest


@pytest.fixture
def vllm_env():
    """A default VllmConfig made current, a 1-rank gloo group, swaps registered.

    Per test, not per session: an engine in the test's process (``llm_in_process``)
    tears the process's groups down when it shuts down."""
    from spyre_inference.ops import register_ops
    from spyre_inference.testing.layer_env import single_rank_vllm

    register_ops()
    with single_rank_vllm("spyre-ops-dist-") as config:
        yield config


@pytest.fixture(scope="module")
def module_vllm_env():
    """``vllm_env`` for a module's shared fixtures (a model built once per module);
    such a module starts no engine in the test's process."""
    from spyre_inference.ops import register_ops
    from spyre_inference.testing.layer_env import single_rank_vllm

    register_ops()
    with single_rank_vllm("spyre-ops-dist-") as config:
        yield config


@pytest.fixture
def llm_in_process() -> bool:
    """``make_llm`` engines in the test's process: these tests are about what the
    swapped layers compute; the engine process as deployed is covered end to end
    (``tests/``). Modules whose subject is per-process state override it."""
    return True


@pytest.fixture
def make_llm(make_llm, monkeypatch):
    """The testing plugin's ``make_llm``, with ``VLLM_PLUGINS`` limited to the platform
    and this package's plugin, so these tests see exactly what an install of the core
    and the ops package gives (the attention backend is found through the core's own
    entry points)."""
    monkeypatch.setenv("VLLM_PLUGINS", "spyre,spyre_ops")
    return make_llm
