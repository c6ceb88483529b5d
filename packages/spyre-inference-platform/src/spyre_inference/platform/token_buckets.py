"""Packed num_tokens buckets for the compiled block graphs.

Every graph is compiled ``dynamic=False`` (torch-spyre's Inductor backend
rejects SymInt shapes), so a step's packed token count is padded up to one of
a small fixed set of sizes; warm-up compiles each of them once. The padding
rows carry token id 0 at position 0, write no KV (slot -1) and are never read
back, so they change no result.
"""

from __future__ import annotations

import bisect

from spyre_inference.platform import settings

#: Smallest bucket. A decode step of a few sequences costs the same as one:
#: at these sizes the block matmuls are bound by reading the weights, not by the
#: token count. Measured with the embedded SmolLM2-135M (30 layers, bfloat16, one
#: thread, minimum of 60 forwards on this 2-core host): 65.2 ms at 1 token,
#: 62.6 at 2, 63.3 at 4, 64.5 at 8, 70.9 at 16. Buckets 1, 2 and 4 would each
#: add a compile per block variant to every warm-up and save nothing per step
#: (``benchmarks/compile_startup.py --bucket-cost`` repeats the measurement).
MIN_BUCKET = 8


def default_buckets(max_num_batched_tokens: int) -> tuple[int, ...]:
    """Powers of two from MIN_BUCKET up to, and always including, the token budget."""
    buckets = []
    size = MIN_BUCKET
    while size < max_num_batched_tokens:
        buckets.append(size)
        size *= 2
    buckets.append(max_num_batched_tokens)
    return tuple(buckets)


class TokenBuckets:
    """The packed num_tokens sizes the block graphs are compiled for.

    ``SPYRE_NUM_TOKENS_BUCKETS`` overrides the default; sizes at or above the
    step budget are dropped and the budget itself is always the largest bucket,
    so every step the scheduler can build has a compiled graph.
    """

    def __init__(self, max_num_batched_tokens: int) -> None:
        configured = settings.get("SPYRE_NUM_TOKENS_BUCKETS")
        if configured:
            buckets = tuple(b for b in configured if b < max_num_batched_tokens)
            buckets = (*buckets, max_num_batched_tokens)
        else:
            buckets = default_buckets(max_num_batched_tokens)
        self.sizes: tuple[int, ...] = buckets

    def pad(self, num_tokens: int) -> int:
        """The bucket a step of ``num_tokens`` tokens runs at."""
        i = bisect.bisect_left(self.sizes, num_tokens)
        if i == len(self.sizes):
            raise ValueError(
                f"{num_tokens} tokens exceed the largest compiled bucket {self.sizes[-1]} "
                "(max_num_batched_tokens)."
            )
        return self.sizes[i]
