"""The attention shape buckets of the spec ("Attention Backend", key constraints)."""

from __future__ import annotations

import pytest

from spyre_inference.attention.bucketing import AttnBucketer, kv_block_buckets, query_buckets


@pytest.mark.parametrize(
    ("max_num_batched_tokens", "expected"),
    [
        (64, (1, 64)),
        (100, (1, 100)),
        (512, (1, 512)),
        (1000, (1, 512, 1024)),
        (2048, (1, 512, 1024, 1536, 2048)),
    ],
)
def test_query_buckets(max_num_batched_tokens, expected):
    assert query_buckets(max_num_batched_tokens) == expected


@pytest.mark.parametrize(
    ("max_model_len", "block_size", "expected"),
    [
        (2048, 64, (1, 2, 4, 8, 16, 32)),
        (2000, 64, (1, 2, 4, 8, 16, 32)),
        (100, 64, (1, 2)),
        (64, 64, (1,)),
        (3000, 128, (1, 2, 4, 8, 16, 24)),
    ],
)
def test_kv_block_buckets(max_model_len, block_size, expected):
    assert kv_block_buckets(max_model_len, block_size) == expected


def test_bucketer_lookups():
    b = AttnBucketer(block_size=64, max_model_len=3000, max_num_batched_tokens=1024)
    assert b.query_bucket(1) == 1
    assert b.query_bucket(2) == 512
    assert b.query_bucket(512) == 512
    assert b.query_bucket(513) == 1024
    # Past max_num_batched_tokens: still a multiple of the chunk (never truncated).
    assert b.query_bucket(1500) == 1536
    assert b.num_blocks(64) == 1 and b.num_blocks(65) == 2
    assert b.kv_bucket(1) == 1
    assert b.kv_bucket(3) == 4
    assert b.kv_bucket(33) == 47  # cdiv(3000, 64): the last bucket is the maximum itself
    with pytest.raises(ValueError, match="max_model_len"):
        b.kv_bucket(48)
    # Reachable pairs only: a query of 513+ rows needs at least 9 pages of 64.
    assert (1024, 8) not in b.variants() and (1024, 16) in b.variants()
    assert (512, 1) in b.variants() and (1, 1) in b.variants()
    assert all(q != 1 for q, _ in b.variants(include_decode=False))


def test_bucketer_rejects_nonsense():
    with pytest.raises(ValueError):
        query_buckets(0)
    with pytest.raises(ValueError):
        kv_block_buckets(0, 64)
    with pytest.raises(ValueError):
        AttnBucketer(64, 128, 64).query_bucket(0)
