"""Shape buckets for the attention kernels.

Spyre compiles every graph with ``dynamic=False`` (torch-spyre's Inductor
backend rejects SymInt shapes), so a compiled attention kernel is specialised
to one concrete (query length, KV block count). Serving arbitrary requests
therefore means padding both axes up to a small fixed set of sizes and masking
the padding out; warm-up can then pre-compile every reachable variant.

Two axes, bucketed independently (see the spec, "Attention Backend"):

* query length: ``[1]`` (decodes) plus the multiples of
  ``chunk = min(512, max_num_batched_tokens)`` up to
  ``max_num_batched_tokens``;
* KV length, as a number of pages: powers of two from 1 block up to
  ``cdiv(max_model_len, block_size)`` (that maximum itself is the last
  bucket when it is not a power of two).
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Iterator

#: Largest query chunk a prefill bucket grows by (the spec's 512).
MAX_QUERY_CHUNK = 512


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def query_buckets(max_num_batched_tokens: int) -> tuple[int, ...]:
    """``[1]`` plus the multiples of ``min(512, max_num_batched_tokens)``."""
    if max_num_batched_tokens <= 0:
        raise ValueError(f"max_num_batched_tokens must be positive, got {max_num_batched_tokens}")
    chunk = min(MAX_QUERY_CHUNK, max_num_batched_tokens)
    top = cdiv(max_num_batched_tokens, chunk) * chunk
    return tuple(sorted({1, *range(chunk, top + 1, chunk)}))


def kv_block_buckets(max_model_len: int, block_size: int) -> tuple[int, ...]:
    """Powers of two from 1 block up to the blocks ``max_model_len`` needs."""
    if max_model_len <= 0 or block_size <= 0:
        raise ValueError(
            f"max_model_len and block_size must be positive, got {max_model_len}, {block_size}"
        )
    max_blocks = cdiv(max_model_len, block_size)
    buckets = []
    n = 1
    while n < max_blocks:
        buckets.append(n)
        n *= 2
    buckets.append(max_blocks)
    return tuple(buckets)


@dataclasses.dataclass(frozen=True)
class AttnBucketer:
    """Maps a sequence's (query length, KV block count) onto compiled shapes."""

    block_size: int
    max_model_len: int
    max_num_batched_tokens: int

    @property
    def query_chunk(self) -> int:
        return min(MAX_QUERY_CHUNK, self.max_num_batched_tokens)

    @property
    def query_buckets(self) -> tuple[int, ...]:
        return query_buckets(self.max_num_batched_tokens)

    @property
    def kv_block_buckets(self) -> tuple[int, ...]:
        return kv_block_buckets(self.max_model_len, self.block_size)

    def query_bucket(self, query_len: int) -> int:
        """Smallest query bucket holding ``query_len`` rows."""
        if query_len <= 0:
            raise ValueError(f"query_len must be positive, got {query_len}")
        for bucket in self.query_buckets:
            if bucket >= query_len:
                return bucket
        # The scheduler never schedules more than max_num_batched_tokens for one
        # request; stay correct (a fresh compile) rather than fail if it does.
        return cdiv(query_len, self.query_chunk) * self.query_chunk

    def num_blocks(self, seq_len: int) -> int:
        return cdiv(seq_len, self.block_size)

    def kv_bucket(self, num_blocks: int) -> int:
        """Smallest KV bucket (in blocks) holding ``num_blocks`` pages."""
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be positive, got {num_blocks}")
        for bucket in self.kv_block_buckets:
            if bucket >= num_blocks:
                return bucket
        raise ValueError(
            f"a sequence of {num_blocks} blocks of {self.block_size} tokens exceeds "
            f"max_model_len={self.max_model_len}"
        )

    def variants(self) -> Iterator[tuple[int, int]]:
        """Every (query bucket, KV block bucket) a request can land on, for warm-up."""
        return itertools.product(self.query_buckets, self.kv_block_buckets)
