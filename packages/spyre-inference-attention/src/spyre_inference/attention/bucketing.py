"""Shape buckets for the attention kernels.

Spyre compiles every graph with ``dynamic=False`` (torch-spyre's Inductor
backend rejects SymInt shapes), so a compiled attention kernel is specialised
to one concrete shape. Serving arbitrary requests therefore means padding each
axis up to a small fixed set of sizes and masking the padding out; warm-up can
then pre-compile every reachable variant (spec, "Attention Backend", key
constraints).

Decoder axes, bucketed independently:

* query length: ``[1]`` (decodes) plus the multiples of
  ``chunk = min(512, max_num_batched_tokens)`` up to
  ``max_num_batched_tokens``;
* KV length, as a number of pages: powers of two from 1 block up to
  ``cdiv(max_model_len, block_size)`` (that maximum itself is the last
  bucket when it is not a power of two);
* number of sequences (batched-decode kernel only): powers of two from 4 up
  to ``max_num_seqs`` (the maximum itself last), or the list in
  ``SPYRE_ATTN_NUM_SEQS_BUCKETS``.

Encoder axes (no KV cache, a dense padded batch): the padded sequence length
on 64-element sticks growing in powers of two, and the number of sequences in
powers of two.

Each ``*_variants`` method lists exactly the shapes a request can land on for
the configured limits (unreachable pairs, such as a 1024-row query over a
one-page context, are left out), so warm-up compiles what serving needs and
nothing more.
"""

from __future__ import annotations

import bisect
import dataclasses
from collections.abc import Sequence

#: Largest query chunk a prefill bucket grows by (the spec's 512).
MAX_QUERY_CHUNK = 512
#: Smallest num-sequences bucket of the batched-decode kernel (the spec's 4).
MIN_DECODE_SEQS = 4
#: Encoder sequences are padded to whole 64-element sticks.
ENCODER_SEQ_ALIGNMENT = 64


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _powers_of_two_up_to(start: int, top: int) -> tuple[int, ...]:
    """``start, 2*start, ...`` below ``top``, then ``top`` itself."""
    buckets = []
    n = start
    while n < top:
        buckets.append(n)
        n *= 2
    buckets.append(top)
    return tuple(buckets)


def _bucket(buckets: Sequence[int], value: int, what: str) -> int:
    i = bisect.bisect_left(buckets, value)
    if i == len(buckets):
        raise ValueError(f"{what}={value} exceeds the largest bucket {buckets[-1]}")
    return buckets[i]


def lower_bound(buckets: Sequence[int], bucket: int) -> int:
    """Smallest value that lands on ``bucket`` (one more than the previous bucket)."""
    i = buckets.index(bucket)
    return 1 if i == 0 else buckets[i - 1] + 1


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
    return _powers_of_two_up_to(1, cdiv(max_model_len, block_size))


def num_seqs_buckets(max_num_seqs: int, configured: Sequence[int] = ()) -> tuple[int, ...]:
    """Batched-decode batch sizes: powers of two from 4 up to ``max_num_seqs``.

    ``configured`` (``SPYRE_ATTN_NUM_SEQS_BUCKETS``) replaces the powers of
    two; ``max_num_seqs`` is always the last bucket so every batch fits.
    """
    if max_num_seqs <= 0:
        raise ValueError(f"max_num_seqs must be positive, got {max_num_seqs}")
    if configured:
        return (*sorted({b for b in configured if b < max_num_seqs}), max_num_seqs)
    return _powers_of_two_up_to(min(MIN_DECODE_SEQS, max_num_seqs), max_num_seqs)


@dataclasses.dataclass(frozen=True)
class AttnBucketer:
    """Maps a decoder step's shapes onto compiled ones (shared by both layouts)."""

    block_size: int
    max_model_len: int
    max_num_batched_tokens: int
    max_num_seqs: int = 256
    #: ``SPYRE_ATTN_NUM_SEQS_BUCKETS`` (empty: powers of two from 4).
    configured_num_seqs: tuple[int, ...] = ()

    @property
    def query_chunk(self) -> int:
        return min(MAX_QUERY_CHUNK, self.max_num_batched_tokens)

    @property
    def query_buckets(self) -> tuple[int, ...]:
        return query_buckets(self.max_num_batched_tokens)

    @property
    def kv_block_buckets(self) -> tuple[int, ...]:
        return kv_block_buckets(self.max_model_len, self.block_size)

    @property
    def num_seqs_buckets(self) -> tuple[int, ...]:
        return num_seqs_buckets(self.max_num_seqs, self.configured_num_seqs)

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

    def num_seqs_bucket(self, num_seqs: int) -> int:
        """Smallest batched-decode bucket holding ``num_seqs`` sequences."""
        if num_seqs <= 0:
            raise ValueError(f"num_seqs must be positive, got {num_seqs}")
        return _bucket(self.num_seqs_buckets, num_seqs, "num_seqs (max_num_seqs)")

    def _reachable(self, query_bucket: int, kv_bucket: int) -> bool:
        """Can a sequence's (query length, page count) land on this pair?

        A query of ``q`` rows needs at least ``q`` tokens of context, so the
        smallest query of the bucket must fit in the bucket's pages (and in
        max_model_len).
        """
        min_query = lower_bound(self.query_buckets, query_bucket)
        capacity = min(kv_bucket * self.block_size, self.max_model_len)
        return min_query <= min(capacity, self.max_num_batched_tokens)

    def variants(self, include_decode: bool = True) -> list[tuple[int, int]]:
        """(query bucket, KV block bucket) pairs of the per-sequence kernel.

        With the batched-decode kernel on, single-row queries never reach the
        per-sequence kernel; pass ``include_decode=False`` to leave them out.
        """
        return [
            (q, kv)
            for q in self.query_buckets
            if include_decode or q != 1
            for kv in self.kv_block_buckets
            if self._reachable(q, kv)
        ]

    def decode_variants(self) -> list[tuple[int, int]]:
        """(num-seqs bucket, KV block bucket) pairs of the batched-decode kernel."""
        return [(s, kv) for s in self.num_seqs_buckets for kv in self.kv_block_buckets]


@dataclasses.dataclass(frozen=True)
class EncoderBucketer:
    """Buckets of the encoder's dense ``[num_seqs, heads, seq_len, head]`` batch.

    Sequence lengths are padded to whole 64-element sticks (the workspace's
    zero rows); to keep the number of compiled shapes small the padded length
    grows in powers of two (64, 128, 256, ...) up to the longest sequence the
    configuration allows. The batch axis uses powers of two from 1.
    """

    max_model_len: int
    max_num_batched_tokens: int
    max_num_seqs: int

    @property
    def max_seq_len(self) -> int:
        # Encoder-only requests cannot be chunked: a whole sequence is one step.
        return min(self.max_model_len, self.max_num_batched_tokens)

    @property
    def seq_len_buckets(self) -> tuple[int, ...]:
        top = cdiv(self.max_seq_len, ENCODER_SEQ_ALIGNMENT) * ENCODER_SEQ_ALIGNMENT
        return _powers_of_two_up_to(ENCODER_SEQ_ALIGNMENT, top)

    @property
    def num_seqs_buckets(self) -> tuple[int, ...]:
        return _powers_of_two_up_to(1, max(1, min(self.max_num_seqs, self.max_num_batched_tokens)))

    def seq_len_bucket(self, seq_len: int) -> int:
        if seq_len <= 0:
            raise ValueError(f"seq_len must be positive, got {seq_len}")
        for bucket in self.seq_len_buckets:
            if bucket >= seq_len:
                return bucket
        # Longer than the configuration allows: stay correct (a fresh compile).
        return cdiv(seq_len, ENCODER_SEQ_ALIGNMENT) * ENCODER_SEQ_ALIGNMENT

    def num_seqs_bucket(self, num_seqs: int) -> int:
        if num_seqs <= 0:
            raise ValueError(f"num_seqs must be positive, got {num_seqs}")
        for bucket in self.num_seqs_buckets:
            if bucket >= num_seqs:
                return bucket
        return num_seqs

    def variants(self) -> list[tuple[int, int]]:
        """Reachable (num-seqs bucket, seq-len bucket) pairs of the padded path.

        The smallest batch landing on ``(S, L)`` has ``S_min`` sequences, one of
        them longer than the previous length bucket: it needs
        ``(L_min) + (S_min - 1)`` tokens, which must fit in one step.
        """
        out = []
        for s in self.num_seqs_buckets:
            s_min = lower_bound(self.num_seqs_buckets, s)
            for length in self.seq_len_buckets:
                l_min = lower_bound(self.seq_len_buckets, length)
                if l_min + s_min - 1 <= self.max_num_batched_tokens and l_min <= self.max_seq_len:
                    out.append((s, length))
        return out

    def fused_variants(self) -> list[int]:
        """Seq-len buckets of the fused (one sequence, no padding) SDPA path."""
        return [length for length in self.seq_len_buckets if length <= self.max_seq_len]
