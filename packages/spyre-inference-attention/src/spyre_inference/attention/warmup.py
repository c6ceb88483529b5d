"""Warm-up recording: compile every attention kernel variant before serving.

Attention kernels are compiled ``dynamic=False``, one graph per bucket, so a
request landing on a bucket nobody compiled would pay an Inductor compile in
the middle of serving. With ``SPYRE_ATTN_RECORD=1`` (the default) warm-up
walks every variant the bucketers can produce for the configured limits
(:meth:`~spyre_inference.attention.bucketing.AttnBucketer.variants`,
``decode_variants``, the encoder's ``variants`` and ``fused_variants``, and
the KV store per runner token bucket) and runs each once. ``SPYRE_ATTN_RECORD=0``
skips this: each variant then compiles on its first use.

Recording does not call the kernels with hand-made tensors: it runs the
backend's own builder and impl on synthetic steps (one per variant, every page
the null block, all inputs zero) under ``torch.inference_mode`` like serving,
so the compiled graphs are exactly the ones serving asks for (the same cache
tensor, index tensors, mask dtype and static arguments). Layers that share a
kernel signature (heads, head size, scale, soft-cap, ALiBi, cache shape) are
recorded once; sliding windows only change mask values, not graphs.

Entry point for the platform core: every attention backend class of this
package implements the core's
:class:`~spyre_inference.platform.warmup.WarmsUpAttention` (a ``warm_up(plan)``
classmethod that calls :func:`record_backend`); the runner calls it once per
backend class of its attention groups with an
:class:`~spyre_inference.platform.warmup.AttentionWarmUpPlan`, and this module
reads nothing of the runner beyond the plan (the core does not import this
package).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from typing import Any

import torch
from vllm.v1.attention.backend import CommonAttentionMetadata

from spyre_inference.attention import policy
from spyre_inference.attention.bucketing import cdiv, lower_bound
from spyre_inference.attention.ops import compiled
from spyre_inference.platform import device as placement
from spyre_inference.platform.logs import get_logger
from spyre_inference.platform.warmup import AttentionGroupPlan, AttentionWarmUpPlan

logger = get_logger(__name__)


@dataclasses.dataclass
class WarmUpReport:
    """What one backend's warm-up did (returned for tests and logs)."""

    backend: str
    variants: int = 0
    compiled: int = 0
    seconds: float = 0.0
    skipped: str | None = None


@dataclasses.dataclass
class _Step:
    """One synthetic step that lands on one kernel variant."""

    label: str
    run: Callable[[], None]


def _layers(plan: AttentionWarmUpPlan, names: tuple[str, ...]) -> list[Any]:
    return [plan.layers[name] for name in names if name in plan.layers]


def _kv_cache(layer: Any) -> torch.Tensor:
    kv = layer.kv_cache
    if isinstance(kv, (list, tuple)):  # older vLLM: one per virtual engine
        kv = kv[0]
    return kv


def _signature(impl: Any, kv_cache: torch.Tensor | None) -> tuple[Any, ...]:
    """What makes two layers' graphs differ (the window does not: it is mask data)."""
    cache = (
        (tuple(kv_cache.shape), kv_cache.stride(), kv_cache.dtype) if kv_cache is not None else None
    )
    return (
        type(impl),
        impl.num_heads,
        impl.num_kv_heads,
        impl.head_size,
        impl.scale,
        impl.logits_soft_cap,
        getattr(impl, "alibi_slopes", None) is not None,
        getattr(impl, "sinks", None) is not None,
        getattr(impl, "compile_kernels", False),
        getattr(impl, "compile_store", False),
        cache,
    )


def _common_metadata(
    q_lens: list[int], seq_lens: list[int], block_size: int, causal: bool
) -> CommonAttentionMetadata:
    qsl = torch.zeros(len(q_lens) + 1, dtype=torch.int32)
    qsl[1:] = torch.tensor(q_lens, dtype=torch.int32).cumsum(0)
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    max_blocks = max(cdiv(s, block_size) for s in seq_lens)
    num_tokens = sum(q_lens)
    return CommonAttentionMetadata(
        query_start_loc=qsl,
        query_start_loc_cpu=qsl.clone(),
        seq_lens=lens,
        seq_lens_cpu_upper_bound=lens.clone(),
        num_reqs=len(q_lens),
        num_actual_tokens=num_tokens,
        max_query_len=max(q_lens),
        max_seq_len=max(seq_lens),
        # Every page is the null block: the graphs only depend on shapes.
        block_table_tensor=torch.zeros((len(q_lens), max_blocks), dtype=torch.int32),
        slot_mapping=torch.full((num_tokens,), -1, dtype=torch.int64),
        causal=causal,
    )


def _decoder_steps(
    plan: AttentionWarmUpPlan, group: AttentionGroupPlan, impl: Any, kv_cache: torch.Tensor
) -> list[_Step]:
    builder = group.builder
    bucketer = builder.bucketer
    block_size = builder.block_size
    max_len = bucketer.max_model_len
    dtype = kv_cache.dtype
    steps: list[_Step] = []

    def attend(q_lens: list[int], seq_lens: list[int]) -> None:
        cm = _common_metadata(q_lens, seq_lens, block_size, causal=True)
        metadata = builder.build(0, cm)
        n = cm.num_actual_tokens
        query = torch.zeros(
            (n, impl.num_heads, impl.head_size), dtype=dtype, device=kv_cache.device
        )
        kv = torch.zeros(
            (n, impl.num_kv_heads, impl.head_size), dtype=dtype, device=kv_cache.device
        )
        impl.forward(None, query, kv, kv, kv_cache, metadata, output=torch.empty_like(query))

    def seq_len_for(kv_bucket: int) -> int:
        return min(kv_bucket * block_size, max_len)

    # On the cpu target's host kernels (decode rows and prefill flash) no page
    # attention graph is ever entered: nothing to record but the KV store.
    host = builder.host_rows_capable()
    variants = [] if host else bucketer.variants(include_decode=not builder.batched_decode)
    for q_bucket, kv_bucket in variants:
        q_len = (
            1
            if q_bucket == 1
            else bucketer.query_buckets[bucketer.query_buckets.index(q_bucket) - 1] + 1
        )
        seq_len = max(seq_len_for(kv_bucket), q_len)
        assert bucketer.kv_bucket(cdiv(seq_len, block_size)) == kv_bucket
        steps.append(
            _Step(
                f"{impl.layout_name} page attention q={q_bucket} pages={kv_bucket}",
                lambda q_len=q_len, seq_len=seq_len: attend([q_len], [seq_len]),
            )
        )
    if builder.batched_decode and not host:
        for num_seqs, kv_bucket in bucketer.decode_variants():
            seq_len = seq_len_for(kv_bucket)
            steps.append(
                _Step(
                    f"batched decode seqs={num_seqs} pages={kv_bucket}",
                    lambda n=num_seqs, s=seq_len: attend([1] * n, [s] * n),
                )
            )
    sizes = plan.token_buckets
    # The host kernels' layout stores eagerly on the cpu target (policy.host_kv_store).
    if impl.compile_store and sizes and not (host and policy.host_kv_store()):
        for num_tokens in sizes:

            def store(n: int = num_tokens) -> None:
                kv = torch.zeros(
                    (n, impl.num_kv_heads, impl.head_size), dtype=dtype, device=kv_cache.device
                )
                slots = torch.full((n,), -1, dtype=torch.int64)  # all to the null slot
                impl.do_kv_cache_update(None, kv, kv, kv_cache, slots)

            steps.append(_Step(f"{impl.layout_name} KV store tokens={num_tokens}", store))
    return steps


def _encoder_steps(plan: AttentionWarmUpPlan, group: AttentionGroupPlan, impl: Any) -> list[_Step]:
    builder = group.builder
    bucketer = builder.bucketer
    dtype = plan.model_dtype
    # The encoder's Q/K/V come from the device in serving; warm-up inputs must
    # too, or (the variant key holds the device type) every served variant on
    # the card would compile on first use.
    device = placement.device()
    steps: list[_Step] = []

    def attend(seq_lens: list[int]) -> None:
        cm = _common_metadata(seq_lens, seq_lens, 1, causal=False)
        metadata = builder.build(0, cm)
        n = cm.num_actual_tokens
        query = torch.zeros((n, impl.num_heads, impl.head_size), dtype=dtype, device=device)
        kv = torch.zeros((n, impl.num_kv_heads, impl.head_size), dtype=dtype, device=device)
        impl.forward(None, query, kv, kv, None, metadata, output=torch.empty_like(query))

    for num_seqs, length in bucketer.variants():
        s_min = lower_bound(bucketer.num_seqs_buckets, num_seqs)
        l_min = lower_bound(bucketer.seq_len_buckets, length)
        if s_min == 1 and l_min == length:
            continue  # a single full-length sequence takes the fused path instead
        lens = [l_min] + [1] * (s_min - 1)
        steps.append(
            _Step(
                f"encoder padded seqs={num_seqs} len={length}",
                lambda lens=lens: attend(lens),
            )
        )
    if impl.sliding_window is None and impl.logits_soft_cap is None:
        for length in bucketer.fused_variants():
            steps.append(
                _Step(f"encoder fused len={length}", lambda length=length: attend([length]))
            )
    return steps


def record_backend(backend_cls: type, plan: AttentionWarmUpPlan) -> WarmUpReport:
    """Compile every kernel variant ``backend_cls``'s layers can reach when serving."""
    name = getattr(backend_cls, "__name__", str(backend_cls))
    report = WarmUpReport(name)
    if not policy.record_at_warm_up():
        report.skipped = "SPYRE_ATTN_RECORD=0 (lazy compilation)"
        logger.info("Attention warm-up (%s) skipped: %s", name, report.skipped)
        return report

    steps: list[_Step] = []
    seen: set[tuple[Any, ...]] = set()
    for group in plan.groups:
        if group.backend is not backend_cls:
            continue
        for layer in _layers(plan, group.layer_names):
            impl = layer.impl
            # The builder says which steps its layers need (a class attribute,
            # not an isinstance: the backends import this module).
            encoder = group.builder.warm_up_form == "encoder"
            kv_cache = None if encoder else _kv_cache(layer)
            signature = _signature(impl, kv_cache)
            # The encoder impl has no KV store to compile (no KV cache).
            compiles = impl.compile_kernels or getattr(impl, "compile_store", False)
            if signature in seen or not compiles:
                continue
            seen.add(signature)
            if encoder:
                steps += _encoder_steps(plan, group, impl)
            elif kv_cache is not None and kv_cache.numel() > 0:
                steps += _decoder_steps(plan, group, impl, kv_cache)

    report.variants = len(steps)
    if not steps:
        report.skipped = "no attention graph to compile (eager, or the cpu target's host kernels)"
        logger.info("Attention warm-up (%s): nothing to record: %s.", name, report.skipped)
        return report

    logger.info(
        "Attention warm-up (%s): recording %d kernel variants for %d layer signature(s)",
        name,
        len(steps),
        len(seen),
    )
    start = time.perf_counter()
    before = compiled.stats.recorded
    with compiled.recording(), torch.inference_mode():
        for i, step in enumerate(steps, 1):
            t0 = time.perf_counter()
            step.run()
            logger.info(
                "Attention warm-up %d/%d: %s in %.1f s (%.1f s total)",
                i,
                len(steps),
                step.label,
                time.perf_counter() - t0,
                time.perf_counter() - start,
            )
    compiled.mark_recorded()
    report.compiled = compiled.stats.recorded - before
    report.seconds = time.perf_counter() - start
    logger.info(
        "Attention warm-up (%s) done: %d variants (%d new graphs) in %.1f s",
        name,
        report.variants,
        report.compiled,
        report.seconds,
    )
    return report
