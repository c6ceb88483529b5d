"""Fixtures of the models package's tests.

Tiny models and ``make_llm`` (``vllm.LLM`` engines shut down after each test)
come from the testing distribution's pytest plugin.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest


@pytest.fixture
def vllm_env() -> Iterator[Any]:
    """A default VllmConfig made current and a 1-rank gloo group, for layer tests
    (vLLM layers read both when they are constructed). Per test, not per session:
    an engine in the test's process (``llm_in_process``) tears the process's groups
    down when it shuts down."""
    from spyre_inference.testing.layer_env import single_rank_vllm

    with single_rank_vllm("spyre-models-dist-") as config:
        yield config


@pytest.fixture
def llm_in_process() -> bool:
    """``make_llm`` engines in the test's process: these tests are about what a model
    computes; the engine process as deployed is covered end to end (``tests/``)."""
    return True
