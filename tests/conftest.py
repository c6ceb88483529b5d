"""End-to-end tests with the full set of packages: engine, `vllm serve`, references."""

from __future__ import annotations

from typing import Any

import pytest


@pytest.fixture
def llm_defaults() -> dict[str, Any]:
    """The testing plugin's ``make_llm`` defaults, with 16 sequences."""
    return {"max_model_len": 512, "max_num_seqs": 16, "max_num_batched_tokens": 128}


def pytest_itemcollected(item: pytest.Item) -> None:
    """Record ``@pytest.mark.feature(...)`` names as junit properties.

    ``tools/support_matrix.py`` builds ``docs/support-matrix.md`` from the junit
    XML of a test run; a ``feature`` property maps the test to its features.
    """
    for mark in item.iter_markers("feature"):
        for name in mark.args:
            item.user_properties.append(("feature", str(name)))
