"""Fixtures of the comms package's tests: a pair of real ranks on gloo."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from rank_pair import Ranks


def pytest_configure(config: pytest.Config) -> None:
    # Registered here too so the package's tests run from its own folder.
    config.addinivalue_line("markers", "spyre: needs a Spyre card (skipped without one)")


@pytest.fixture(scope="module")
def ranks() -> Iterator[Ranks]:
    """Two cpu-target ranks in a TP=2 vLLM distributed environment on gloo."""
    pair = Ranks(world_size=2, backend="gloo", target="cpu")
    yield pair
    pair.close()
