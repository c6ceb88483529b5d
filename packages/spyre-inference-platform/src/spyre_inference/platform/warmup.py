"""Warm-up: compile every graph serving can reach before the first request.

Every graph is compiled ``dynamic=False``, so a request landing on a shape
nobody compiled pays an Inductor compile (seconds on the host, more on the
card) in the middle of serving. Warm-up therefore runs:

* one dummy step per packed num_tokens bucket
  (:class:`~spyre_inference.platform.token_buckets.TokenBuckets`) through the
  runner's own ``_dummy_run``, which pads onto the bucket exactly as a served
  step does, under ``torch.inference_mode`` as serving does; this compiles each
  block variant once per bucket (or the whole-model graph per bucket);
* the sampler's logprobs helper: vLLM wraps ``batched_count_greater_than`` in
  ``torch.compile`` with the platform's ``simple_compile_backend`` regardless
  of the compilation mode, and it otherwise compiles on the first request that
  asks for logprobs. Its batch axis is unbacked (vLLM marks it), so one call
  covers every batch size.

Progress is logged per bucket with whether Inductor compiled the graphs or
loaded them from its on-disk cache, and an estimate of the time left.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

import torch
from torch._dynamo.utils import counters

from spyre_inference.platform.block_compile import CompileReport, check_depth_independence
from spyre_inference.platform.logs import get_logger

logger = get_logger(__name__)


@dataclasses.dataclass(frozen=True)
class AttentionGroupPlan:
    """One KV-cache group of one attention backend, as warm-up sees it."""

    backend: type
    layer_names: tuple[str, ...]
    #: The group's metadata builder: warm-up plans its synthetic steps with it,
    #: so they land on exactly the kernel variants serving will.
    builder: Any


@dataclasses.dataclass(frozen=True)
class AttentionWarmUpPlan:
    """Everything an attention backend reads to compile the kernel variants serving
    can reach, and nothing else of the runner (the contract of :class:`WarmsUpAttention`).
    """

    groups: tuple[AttentionGroupPlan, ...]
    #: layer name -> vLLM's attention layer (its ``impl`` and bound ``kv_cache``)
    layers: Mapping[str, Any]
    #: the runner's num_tokens buckets (the KV store compiles one graph per bucket)
    token_buckets: tuple[int, ...]
    model_dtype: torch.dtype


@runtime_checkable
class WarmsUpAttention(Protocol):
    """An attention backend class that records its kernel variants at warm-up.

    The runner calls ``warm_up`` once per backend class of its attention groups,
    with one plan for all; the core never imports a backend by name.
    """

    @classmethod
    def warm_up(cls, plan: AttentionWarmUpPlan) -> object: ...


@dataclasses.dataclass
class WarmUpStats:
    """What a block warm-up did (returned for tests and benchmarks)."""

    buckets: tuple[int, ...]
    seconds: float = 0.0
    #: New Dynamo graphs per compiled class (one per block variant and bucket).
    graphs: dict[str, int] = dataclasses.field(default_factory=dict)
    #: Inductor graphs compiled from scratch / loaded from the FX graph cache.
    inductor_compiled: int = 0
    inductor_cached: int = 0
    depth_independent: bool = True


def _inductor_counts() -> tuple[int, int]:
    c = counters["inductor"]
    return c["fxgraph_cache_miss"] + c["fxgraph_cache_bypass"], c["fxgraph_cache_hit"]


def warm_up_buckets(
    report: CompileReport,
    buckets: Sequence[int],
    dummy_step: Callable[[int], object],
) -> WarmUpStats:
    """Run ``dummy_step(num_tokens)`` for every bucket, largest first, with progress logs.

    Largest first: it needs the most memory, so a configuration that cannot
    fit fails at once rather than after every smaller bucket has compiled.
    """
    order = sorted(buckets, reverse=True)
    stats = WarmUpStats(tuple(order))
    before_graphs = report.artifacts()
    miss0, hit0 = _inductor_counts()
    start = time.perf_counter()
    what = (
        "blocks " + ", ".join(f"{n} x{c}" for n, c in report.classes.items())
        if report.granularity == "block"
        else f"whole model {next(iter(report.classes))}"
    )
    logger.info(
        "Warm-up: %d num_tokens buckets %s (%s); Inductor cache %s",
        len(order),
        order,
        what,
        report.cache_dir,
    )
    durations: list[float] = []
    for i, size in enumerate(order, 1):
        t0 = time.perf_counter()
        g0 = report.total_artifacts()
        m0, h0 = _inductor_counts()
        dummy_step(size)
        dt = time.perf_counter() - t0
        durations.append(dt)
        m1, h1 = _inductor_counts()
        left = len(order) - i
        # The first bucket carries Inductor's start-up; later ones are alike.
        per = sum(durations[1:]) / (len(durations) - 1) if len(durations) > 1 else dt
        logger.info(
            "Warm-up %d/%d: num_tokens=%d: %d new graphs; Inductor compiled %d, loaded %d "
            "from cache; %.1f s (%.1f s total%s)",
            i,
            len(order),
            size,
            report.total_artifacts() - g0,
            m1 - m0,
            h1 - h0,
            dt,
            time.perf_counter() - start,
            f", about {per * left:.0f} s left" if left else "",
        )
    stats.seconds = time.perf_counter() - start
    after = report.artifacts()
    stats.graphs = {n: after[n] - before_graphs.get(n, 0) for n in after}
    miss1, hit1 = _inductor_counts()
    stats.inductor_compiled = miss1 - miss0
    stats.inductor_cached = hit1 - hit0
    per_bucket = ", ".join(
        f"{n}: {g / max(1, len(order)):g} per bucket" for n, g in stats.graphs.items()
    )
    logger.info(
        "Warm-up done in %.1f s: %d graphs (%s); Inductor compiled %d, loaded %d from cache.",
        stats.seconds,
        sum(stats.graphs.values()),
        per_bucket,
        stats.inductor_compiled,
        stats.inductor_cached,
    )
    stats.depth_independent = check_depth_independence(report)
    return stats


@torch.inference_mode()
def warm_up_logprobs(
    compute_logits: Callable[[torch.Tensor], torch.Tensor | None],
    hidden: int,
    dtype: torch.dtype,
    device: torch.device,
) -> float:
    """Compile vLLM's logprobs helper through the sampler's own code path; returns seconds.

    Calls ``Sampler.compute_logprobs`` and ``Sampler.gather_logprobs`` on real
    logits of the model (so the vocab axis is the one serving produces), for two
    rows: ``gather_logprobs`` marks the batch axis unbacked, so the one graph
    serves every batch size of both sampled and prompt logprobs.
    """
    from vllm.v1.sample.sampler import Sampler

    t0 = time.perf_counter()
    states = torch.zeros(2, hidden, dtype=dtype, device=device)
    logits = compute_logits(states)
    if logits is None:  # not the last pipeline rank
        return 0.0
    logprobs = Sampler.compute_logprobs(logits)
    token_ids = torch.zeros(logprobs.shape[0], dtype=torch.int64, device=logprobs.device)
    Sampler.gather_logprobs(logprobs, 1, token_ids)
    return time.perf_counter() - t0
