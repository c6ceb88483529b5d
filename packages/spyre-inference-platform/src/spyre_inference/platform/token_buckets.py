"""Packed num_tokens buckets for the compiled block graphs.

Every graph is compiled ``dynamic=False`` (torch-spyre's Inductor backend
rejects SymInt shapes), so a step's packed token count is padded up to one of
a small fixed set of sizes; warm-up compiles each of them once. The padding
rows carry token id 0 at position 0, write no KV (slot -1) and are never read
back, so they change no result.
"""

from __future__ import annotations

import bisect

from spyre_inference.platform import device, settings

#: Smallest default bucket on the card's path (spyre and emulated targets): each
#: bucket is one more compile per block variant at warm-up, which is the card's
#: dearest start-up cost, and its matmul tiles pad small row counts anyway.
MIN_BUCKET = 8

#: Smallest default bucket on the cpu target: a decode step of one, two or four
#: sequences runs at its own size. There the GEMM of a few rows streams the weights
#: once and costs more with every padding row (the host kernel serves one or two
#: rows, ``SPYRE_CPU_GEMM_HOST_ROWS``; oneDNN or the kernel's many-rows path the
#: rest). SmolLM2-135M on a 2-core AMD Zen 4 (``benchmarks/decode_ab.py``, 2 rounds
#: alternated): batch-1 decode 26.2 ms/token with 8 as the smallest bucket, 22.0
#: with 1; the three small buckets add six small graphs to a cold warm-up.
CPU_MIN_BUCKET = 1

#: Smallest bucket with LoRA: vLLM's punica LoRA ops (``lora.ops.torch_ops``)
#: cannot be traced for a 1-token step (Dynamo stops on the data-dependent guard
#: ``Eq(u, 1)`` of their slice-add, in the middle of serving), so with LoRA the
#: cpu target's default starts at 2 and a configured 1 is refused at start-up.
LORA_MIN_BUCKET = 2


#: cpu target: from this size up, a bucket halfway between two powers of two
#: (384, 768, 1536, ...). There a step's cost is its GEMMs, linear in the rows,
#: so every padding row is paid in full; the card's path keeps powers of two
#: (each bucket is a compile, its dearest start-up cost). With
#: ``bucket_scheduler`` cutting a step in the lower half of a gap to the bucket
#: below, a step pads by at most a sixth instead of a third. SmolLM2-135M on a
#: 2-core AMD Zen 4, ``vllm bench serve`` W3 (8 clients, 128-token prompts): a
#: wave's third prefill step of 385-389 tokens ran at 512 in ~330 ms, at 384 in
#: ~260 ms; TTFT median 555 -> 452 ms. Each one is a bucket more at warm-up.
CPU_MID_BUCKETS_FROM = 256


def smallest_default_bucket(lora: bool) -> int:
    """The smallest default bucket on this target (with LoRA enabled or not)."""
    if device.is_spyre():
        return MIN_BUCKET
    return LORA_MIN_BUCKET if lora else CPU_MIN_BUCKET


def default_buckets(
    max_num_batched_tokens: int, smallest: int = MIN_BUCKET, mid_from: int | None = None
) -> tuple[int, ...]:
    """Powers of two from ``smallest`` up to, and always including, the token budget;
    from ``mid_from`` up also each halfway point (1.5x a power of two)."""
    buckets = []
    size = smallest
    while size < max_num_batched_tokens:
        buckets.append(size)
        if mid_from is not None and size >= mid_from and size * 3 // 2 < max_num_batched_tokens:
            buckets.append(size * 3 // 2)
        size *= 2
    buckets.append(max_num_batched_tokens)
    return tuple(buckets)


def default_mid_from() -> int | None:
    """Where halfway buckets start on this target (``None``: powers of two only)."""
    return None if device.is_spyre() else CPU_MID_BUCKETS_FROM


class TokenBuckets:
    """The packed num_tokens sizes the block graphs are compiled for.

    The default is powers of two from :data:`CPU_MIN_BUCKET` on the cpu target
    (:data:`LORA_MIN_BUCKET` with LoRA), with halfway buckets from
    :data:`CPU_MID_BUCKETS_FROM`, and from :data:`MIN_BUCKET` on the card's path.
    ``SPYRE_NUM_TOKENS_BUCKETS`` overrides it; sizes at or above the step budget
    are dropped and the budget itself is always the largest bucket, so every step
    the scheduler can build has a compiled graph.
    """

    def __init__(self, max_num_batched_tokens: int, lora: bool = False) -> None:
        configured = settings.get("SPYRE_NUM_TOKENS_BUCKETS")
        if configured:
            buckets = tuple(b for b in configured if b < max_num_batched_tokens)
            buckets = (*buckets, max_num_batched_tokens)
        else:
            buckets = default_buckets(
                max_num_batched_tokens, smallest_default_bucket(lora), default_mid_from()
            )
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
