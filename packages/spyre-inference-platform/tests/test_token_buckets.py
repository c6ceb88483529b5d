from __future__ import annotations

import pytest

from spyre_inference.platform import device, settings
from spyre_inference.platform.token_buckets import TokenBuckets


@pytest.fixture(autouse=True)
def _fresh(monkeypatch):
    monkeypatch.delenv("SPYRE_NUM_TOKENS_BUCKETS", raising=False)
    settings.reset_cache()
    yield
    settings.reset_cache()


def test_default_buckets_cover_the_budget() -> None:
    """cpu target: from 1 (a decode step of one sequence runs at one row)."""
    assert not device.is_spyre()
    b = TokenBuckets(200)
    assert b.sizes == (1, 2, 4, 8, 16, 32, 64, 128, 200)
    assert [b.pad(n) for n in (1, 3, 8, 9, 129, 200)] == [1, 4, 8, 16, 200, 200]
    with pytest.raises(ValueError, match="exceed"):
        b.pad(201)


def test_card_path_default_buckets_start_at_8(monkeypatch) -> None:
    """The card's path (here the emulated card) keeps 8 as the smallest default bucket:
    each bucket is one more compile per block variant, its dearest start-up cost."""
    monkeypatch.setenv("SPYRE_DEVICE_TARGET", "emulated")
    settings.reset_cache()
    device.reset_for_tests()
    try:
        assert device.is_spyre()
        b = TokenBuckets(200)
        assert b.sizes == (8, 16, 32, 64, 128, 200)
        assert b.pad(1) == 8
    finally:
        monkeypatch.delenv("SPYRE_DEVICE_TARGET")
        settings.reset_cache()
        device.reset_for_tests()


def test_configured_buckets_always_end_at_the_budget(monkeypatch) -> None:
    monkeypatch.setenv("SPYRE_NUM_TOKENS_BUCKETS", "4,32,1024")
    settings.reset_cache()
    assert TokenBuckets(256).sizes == (4, 32, 256)
