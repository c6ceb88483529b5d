"""pytest plugin that runs vLLM's own attention-backend tests against the Spyre backend.

Loaded with ``-p spyre_vllm_suite_plugin`` by ``test_vllm_attention_suite.py``,
in a pytest process rooted in the tests extracted from the vLLM sdist, with
``--noconftest`` (vLLM's root conftest pulls in GPU/model fixtures this suite
does not need). It does three things and nothing else:

* registers the token-major backend as vLLM's ``AttentionBackendEnum.CUSTOM``
  (vLLM's documented hook for an out-of-tree backend) and makes it the only
  entry of the module's ``BACKENDS_TO_TEST``, so every parametrized test runs
  vLLM's reference comparison against it;
* turns off the second, FlexAttention-only pass some tests make at
  ``block_size=128`` when ``is_torch_equal_or_newer("2.9.0.dev0")``: it runs
  the ``FLEX_ATTENTION`` backend, not the backend under test, and needs a GPU
  Triton path;
* provides ``default_vllm_config``, the one fixture of vLLM's conftest the
  selected tests use (same body as upstream).

Nothing in vLLM's test logic, tolerances, data or reference is changed.
"""

from __future__ import annotations

import pytest

TOKEN_MAJOR = "spyre_inference.attention.backends.token_major.SpyreAttentionBackend"
_patched: set[str] = set()


def pytest_configure(config: pytest.Config) -> None:
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    register_backend(AttentionBackendEnum.CUSTOM, TOKEN_MAJOR)


def pytest_collection_modifyitems(session, config, items) -> None:
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    for item in items:
        module = getattr(item, "module", None)
        if module is None or module.__name__ in _patched:
            continue
        if not module.__name__.endswith("test_attention_backends"):
            continue
        _patched.add(module.__name__)
        module.BACKENDS_TO_TEST = [AttentionBackendEnum.CUSTOM]
        if hasattr(module, "SLIDING_WINDOW_BACKENDS_TO_TEST"):
            module.SLIDING_WINDOW_BACKENDS_TO_TEST = [AttentionBackendEnum.CUSTOM]
        newer = module.is_torch_equal_or_newer

        def flex_large_block_pass_off(version: str, _newer=newer) -> bool:
            return False if version == "2.9.0.dev0" else _newer(version)

        module.is_torch_equal_or_newer = flex_large_block_pass_off


@pytest.fixture
def default_vllm_config():
    from vllm.config import VllmConfig, set_current_vllm_config

    config = VllmConfig()
    with set_current_vllm_config(config):
        yield config


def pytest_sessionfinish(session, exitstatus) -> None:
    """Leave evidence that the Spyre kernels, not another backend, ran."""
    import json
    import os

    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    from spyre_inference.attention import ops
    from spyre_inference.attention.ops import compiled

    path = os.environ.get("SPYRE_VLLM_SUITE_REPORT")
    if not path:
        return
    report = {
        "custom_backend": AttentionBackendEnum.CUSTOM.get_path(),
        "page_attention_variants": len(ops.PAGE_ATTENTION),
        "batched_decode_variants": len(ops.BATCHED_DECODE),
        "host_decode_calls": ops.host_decode.calls(),
        "compiled_graphs": compiled.stats.total,
    }
    with open(path, "w") as f:
        json.dump(report, f)
