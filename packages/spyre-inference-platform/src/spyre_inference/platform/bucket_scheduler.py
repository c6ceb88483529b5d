"""vLLM's scheduler, with each step's token budget cut at a num_tokens bucket edge.

Every compiled step runs at a fixed bucket size (:mod:`token_buckets`; the
spec's ``dynamic=False`` graphs), so a step of 135 tokens costs what a step of
256 does. That is the common shape of serving: a prompt joins a batch of
running decodes, and the decodes push its prefill just past a bucket edge (128
prompt tokens + 7 decodes -> 135 -> bucket 256; SmolLM2-135M on a 2-core Zen 4:
179 ms for that step against 103.5 ms for 128 tokens).

With chunked prefill the scheduler may split any prompt, so the plugin lowers
the step's budget to the bucket below when the prefill would spill only a
little past it. The spilled tokens run in a later step next to the decodes,
where they cost rows of a small bucket instead of half a large one. Decodes are
never cut: the budget is only lowered to an edge above every decode token (and
above every running request ahead of the last decode), and always above them by
at least one token, so a joining prompt keeps making progress every step.

This is vLLM's own scheduling algorithm (``Scheduler.schedule``) with a
different budget for one call; it is plugged in through vLLM's documented
``SchedulerConfig.scheduler_cls`` by the platform when the model is compiled,
chunked prefill is on and the user named no scheduler of their own
(``SPYRE_BUCKET_ALIGNED_PREFILL``).
"""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.request import Request

from spyre_inference.platform.token_buckets import TokenBuckets

#: The smallest bucket a budget is cut to. A step has a fixed cost besides its
#: rows (SmolLM2-135M on a 2-core Zen 4, ``benchmarks/step_budget.py``: 16.5 ms
#: at one row, then ~0.66 ms per row up to 256), worth ~25 rows; a cut can add a
#: step for the deferred tokens, or pad the next one further. Below 64 rows the
#: padding a cut saves is of that order, above it the saving dominates.
MIN_CUT_BUCKET = 64


def aligned_budget(buckets: Sequence[int], budget: int, protected: int, demand: int) -> int:
    """The token budget for one step.

    ``buckets`` are the compiled sizes (ascending), ``budget`` the step's usual
    token budget, ``protected`` the tokens that must run this step (every
    decode, and every running request scheduled ahead of the last decode), and
    ``demand`` all the tokens the step could take. When ``demand`` lands in the
    lower half of the gap between two buckets, the budget becomes the lower
    bucket, provided it still leaves at least one token of prefill; otherwise it
    stays ``budget``. Padding less than half the gap is cheaper than deferring.
    """
    total = min(demand, budget)
    i = bisect.bisect_left(buckets, total)
    if i == 0 or i == len(buckets) or buckets[i] == total:
        return budget
    lower, upper = buckets[i - 1], buckets[i]
    if lower < MIN_CUT_BUCKET or lower <= protected or 2 * (total - lower) > upper - lower:
        return budget
    return lower


def _needed(request: Request) -> int:
    """Tokens ``request`` asks for this step (vLLM's own count in ``schedule``)."""
    return (
        request.num_tokens_with_spec + request.num_output_placeholders - request.num_computed_tokens
    )


def step_demand(
    running: Iterable[Request], waiting: Iterable[Request], free_slots: int, budget: int
) -> tuple[int, int]:
    """``(protected, demand)`` for :func:`aligned_budget`.

    Running requests are taken in vLLM's order; a request asking for no more
    than one token plus its drafts is decoding. Waiting requests fill the free
    sequence slots with their uncomputed tokens (prefix-cache hits are not
    known yet, so this may overestimate, which only makes the cut bind less).
    """
    protected = demand = 0
    for request in running:
        need = _needed(request)
        if need <= 0:
            continue
        demand += need
        if need <= 1 + len(request.spec_token_ids):
            protected = demand
    for request in waiting:
        if free_slots <= 0 or demand >= budget:
            break
        demand += max(request.num_tokens - request.num_computed_tokens, 1)
        free_slots -= 1
    return protected, demand


@dataclass
class AlignmentStats:
    """What the scheduler did: steps scheduled, steps whose budget it cut."""

    steps: int = 0
    cut_steps: int = 0


class BucketAlignedScheduler(Scheduler):
    """``Scheduler`` whose step budget ends at a bucket edge when that is cheaper."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.token_buckets = TokenBuckets(
            self.scheduler_config.max_num_batched_tokens, lora=self.lora_config is not None
        )
        self.alignment = AlignmentStats()

    def schedule(self, throttle_prefills: bool = False) -> SchedulerOutput:
        budget = self.max_num_scheduled_tokens
        protected, demand = step_demand(
            self.running,
            itertools.chain(self.kv_holding_waiting, self.waiting),
            self.max_num_running_reqs - len(self.running),
            budget,
        )
        cut = aligned_budget(self.token_buckets.sizes, budget, protected, demand)
        self.alignment.steps += 1
        if cut >= budget:
            return super().schedule(throttle_prefills)
        self.alignment.cut_steps += 1
        # vLLM reads the budget from this attribute at the top of schedule()
        # and asserts the step against it at the end; restore it for the next.
        self.max_num_scheduled_tokens = cut
        try:
            return super().schedule(throttle_prefills)
        finally:
            self.max_num_scheduled_tokens = budget
