"""Spyre cost proxies of the plugin, counted per decode step on the cpu target.

On the card every host<->device conversion, every eager op on the device and
every compiled-graph launch has a fixed cost that the cpu target does not pay,
so the cpu target's timings say little about them. Counted instead:

* **host<->device conversions**: ``spyre_inference.platform.device.transfers``
  (the conversions the card would make; on the cpu target they are counted
  though no copy happens);
* **eager device ops**: aten ops dispatched inside the model's forward or its
  logits computation that are *not* part of a compiled graph (ops inside an
  opaque custom op called from a compiled graph, such as attention's
  orchestration, count as eager: on the card each is its own launch);
* **compiled-graph calls**: Inductor graphs run (block graphs and attention
  kernels), plus the cpu target's host kernels that stand in for a graph the
  card runs (the decode-attention kernel's profiler range, ``HOST_KERNEL``).

Host work of the runner (input preparation, attention metadata, sampling)
runs on the host on both targets and is reported separately as host ops.

A step is isolated by difference: the same requests once with 1 output token
(prefill only) and once with ``1 + decode_steps``; the difference divided by
``decode_steps`` is the per-decode-step count. The profiler is on for these
passes only, after the timed runs.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

FORWARD = "spyre_bench::forward"
LOGITS = "spyre_bench::logits"
COMPILED = "## Call CompiledFxGraph"
#: Profiler ranges of cpu-target host kernels that replace a compiled graph of
#: the card (spyre_inference.attention.ops.host_decode.PROFILER_RANGE).
HOST_KERNEL = "## Spyre host kernel"
#: cpu-target ops that stand in for a matmul *inside* a block graph (the host
#: GEMM ``spyre_inference.ops.host_gemm.QUALNAME`` and the oneDNN GEMM on
#: prepacked weights ``spyre_inference.ops.onednn_linear.QUALNAME``): what their
#: Python body dispatches (views, the output allocation) is part of that graph
#: on the card, not an eager launch. Counted as eager before 2026-12-03: 3 ops
#: per linear, 364 of the 652 per step measured on CPUs that run the host GEMM.
IN_GRAPH_HOST_OPS = ("spyre_inference::host_gemm_w16", "spyre_inference::onednn_linear_t")
#: Library ops whose own dispatches (an output allocation) are their internals,
#: like an ``aten::`` op's: oneDNN's ``mkldnn::_linear_pointwise``.
LIBRARY_OPS = ("aten::", "mkldnn::")
#: The emulated card's plumbing (``spyre_inference.platform.emulated_card``): the
#: ops that hand a compiled host graph's buffers to an opaque custom op on the
#: device and back. On a card the graph never leaves the device, so what they
#: dispatch (a copy each) is not a card op. Counted as eager before 2026-12-06,
#: with the emulator's host views (two dispatched ops per device operand of every
#: op, now built without the dispatcher): 1228 of the 1436 per step it reported.
EMULATION_OPS = ("spyre_emulated::",)


def _runner(llm: Any) -> Any:
    return llm.llm_engine.model_executor.driver_worker.worker.model_runner


@contextlib.contextmanager
def marked_ranges(runner: Any) -> Iterator[None]:
    """Mark the model forward and the logits computation as profiler ranges."""
    import torch

    forward, logits = runner._model_forward, runner.model.compute_logits

    def marked_forward(*args: Any, **kwargs: Any) -> Any:
        with torch.profiler.record_function(FORWARD):
            return forward(*args, **kwargs)

    def marked_logits(*args: Any, **kwargs: Any) -> Any:
        with torch.profiler.record_function(LOGITS):
            return logits(*args, **kwargs)

    runner._model_forward = marked_forward
    runner.model.compute_logits = marked_logits
    try:
        yield
    finally:
        del runner._model_forward
        del runner.model.compute_logits


def _is_op(name: str) -> bool:
    return "::" in name and not name.startswith(("spyre_bench::", "##"))


def _classify(events: Any) -> dict[str, int]:
    """Count compiled-graph calls, eager device ops and host ops in profiler events."""
    counts = {"compiled_graph_calls": 0, "eager_device_ops": 0, "host_ops": 0}
    for event in events:
        name = event.name
        if name.startswith((COMPILED, HOST_KERNEL)):
            counts["compiled_graph_calls"] += 1
            continue
        if not _is_op(name):
            continue
        # Walk up to the nearest enclosing op, compiled graph or marked range.
        parent = event.cpu_parent
        in_device_region = False
        nested = False
        while parent is not None:
            pname = parent.name
            if pname.startswith((COMPILED, HOST_KERNEL)):
                nested = True  # part of a compiled graph (an extern kernel)
                break
            if pname.startswith((*LIBRARY_OPS, *IN_GRAPH_HOST_OPS, *EMULATION_OPS)):
                nested = True  # counted through its parent op / graph, or emulation
                break
            if _is_op(pname):
                in_device_region = True  # inside an opaque custom op: eager
                break
            if pname in (FORWARD, LOGITS):
                in_device_region = True
                break
            parent = parent.cpu_parent
        if nested:
            continue
        counts["eager_device_ops" if in_device_region else "host_ops"] += 1
    return counts


def _profiled(llm: Any, prompts: list[list[int]], max_tokens: int) -> dict[str, int]:
    import torch
    from vllm import SamplingParams

    from spyre_inference.platform import device as dev

    runner = _runner(llm)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    requests = [{"prompt_token_ids": p} for p in prompts]
    dev.transfers.reset()
    with (
        marked_ranges(runner),
        torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof,
    ):
        llm.generate(requests, params, use_tqdm=False)
    counts = _classify(prof.events())
    counts["h2d"] = dev.transfers.h2d
    counts["d2h"] = dev.transfers.d2h
    return counts


def measure(
    llm: Any, w1: list[list[int]], w2: list[list[int]], decode_steps: int = 8
) -> dict[str, dict[str, float]]:
    """Per-decode-step proxies at batch 1 (W1's prompt) and at W2's batch size."""
    out: dict[str, dict[str, float]] = {}
    # The batch's prompts are cut to 16 tokens so that all 32 prefill in one
    # 512-token step: otherwise chunked prefill spreads over several steps that
    # also carry decodes, and the difference would not be decode steps only.
    batch = [p[:16] for p in w2]
    for label, prompts in ((f"batch {len(w1)}", w1), (f"batch {len(batch)}", batch)):
        _profiled(llm, prompts, 1 + decode_steps)  # profiler warm-up
        prefill = _profiled(llm, prompts, 1)
        full = _profiled(llm, prompts, 1 + decode_steps)
        out[label] = {
            key: round((full[key] - prefill[key]) / decode_steps, 2) for key in sorted(full)
        }
    return out
