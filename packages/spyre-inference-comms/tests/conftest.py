"""Fixtures of the comms package's tests: a pair of real ranks on gloo."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest
from rank_pair import RankPair


def pytest_configure(config: pytest.Config) -> None:
    # Registered here too so the package's tests run from its own folder.
    config.addinivalue_line("markers", "spyre: needs a Spyre card (skipped without one)")


class Ranks:
    """A :class:`RankPair` that is replaced by a fresh one when a test breaks it."""

    def __init__(self, **options: Any) -> None:
        self._options = options
        self._pair: RankPair | None = None

    def run(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> list[Any]:
        if self._pair is not None and self._pair.broken:
            self._pair.close()
            self._pair = None
        if self._pair is None:
            self._pair = RankPair(**self._options)
        return self._pair.run(fn, *args, **kwargs)

    def close(self) -> None:
        if self._pair is not None:
            self._pair.close()
            self._pair = None


@pytest.fixture(scope="module")
def ranks() -> Iterator[Ranks]:
    """Two cpu-target ranks in a TP=2 vLLM distributed environment on gloo."""
    pair = Ranks(world_size=2, backend="gloo", target="cpu")
    yield pair
    pair.close()
