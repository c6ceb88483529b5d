from __future__ import annotations

import pytest

from spyre_inference.platform import settings
from spyre_inference.platform.token_buckets import TokenBuckets


@pytest.fixture(autouse=True)
def _fresh(monkeypatch):
    monkeypatch.delenv("SPYRE_NUM_TOKENS_BUCKETS", raising=False)
    settings.reset_cache()
    yield
    settings.reset_cache()


def test_default_buckets_cover_the_budget() -> None:
    b = TokenBuckets(200)
    assert b.sizes == (8, 16, 32, 64, 128, 200)
    assert [b.pad(n) for n in (1, 8, 9, 129, 200)] == [8, 8, 16, 200, 200]
    with pytest.raises(ValueError, match="exceed"):
        b.pad(201)


def test_configured_buckets_always_end_at_the_budget(monkeypatch) -> None:
    monkeypatch.setenv("SPYRE_NUM_TOKENS_BUCKETS", "4,32,1024")
    settings.reset_cache()
    assert TokenBuckets(256).sizes == (4, 32, 256)
