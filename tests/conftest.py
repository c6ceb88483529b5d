"""End-to-end tests with the full set of packages: engine, `vllm serve`, references."""

from __future__ import annotations

import gc
from collections.abc import Iterator
from typing import Any

import pytest


@pytest.fixture
def make_llm() -> Iterator[Any]:
    """Build ``vllm.LLM`` engines for a test and shut their engine processes down after it."""
    from vllm import LLM

    engines: list[Any] = []

    def factory(model: str, **kwargs: Any) -> LLM:
        kwargs.setdefault("max_model_len", 512)
        kwargs.setdefault("max_num_seqs", 16)
        kwargs.setdefault("max_num_batched_tokens", 128)
        llm = LLM(model=str(model), **kwargs)
        engines.append(llm)
        return llm

    yield factory
    for llm in engines:
        llm.llm_engine.engine_core.shutdown()
    engines.clear()
    gc.collect()


def pytest_itemcollected(item: pytest.Item) -> None:
    """Record ``@pytest.mark.feature(...)`` names as junit properties.

    ``tools/support_matrix.py`` builds ``docs/support-matrix.md`` from the junit
    XML of a test run; a ``feature`` property maps the test to its features.
    """
    for mark in item.iter_markers("feature"):
        for name in mark.args:
            item.user_properties.append(("feature", str(name)))
