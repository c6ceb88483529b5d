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


def test_cpu_default_buckets_add_halfway_points_from_256() -> None:
    """cpu target: 384, 768, 1536 between the large powers of two, none at or past
    the budget; a step of 300 tokens runs at 384, not 512."""
    b = TokenBuckets(2048)
    assert b.sizes == (1, 2, 4, 8, 16, 32, 64, 128, 256, 384, 512, 768, 1024, 1536, 2048)
    assert b.pad(300) == 384 and b.pad(385) == 512
    assert TokenBuckets(512).sizes[-3:] == (256, 384, 512)
    assert TokenBuckets(384).sizes[-2:] == (256, 384)


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
        # Powers of two only: each bucket is a compile on the card.
        assert TokenBuckets(2048).sizes == (8, 16, 32, 64, 128, 256, 512, 1024, 2048)
    finally:
        monkeypatch.delenv("SPYRE_DEVICE_TARGET")
        settings.reset_cache()
        device.reset_for_tests()


def test_configured_buckets_always_end_at_the_budget(monkeypatch) -> None:
    monkeypatch.setenv("SPYRE_NUM_TOKENS_BUCKETS", "4,32,1024")
    settings.reset_cache()
    assert TokenBuckets(256).sizes == (4, 32, 256)
