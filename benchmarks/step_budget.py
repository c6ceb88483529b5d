"""Where a decode step's time goes: the plugin's step budget at batch 1 (and 32).

Not a test: a measurement. Starts the engine in-process on the default model
with the side-by-side benchmark's settings, times decode steps without the
profiler (the totals), then profiles the same requests with ``torch.profiler``
and splits the profiled step into:

* ``GEMM``: the linear layers' ops inside the block graphs (the cpu target's
  oneDNN-on-prepacked-weights op or host GEMM kernel; ``aten::mm``/``addmm``
  when torch's matmul runs);
* ``attention op``: vLLM's ``unified_attention_with_output`` (the KV store,
  then the attention kernels and their Python orchestration), and
  ``kv update op`` when a backend still has a separate one;
* ``attention kernels``: the part of the attention op inside the host kernels'
  and compiled kernels' ranges;
* ``block graphs, rest``: time inside the compiled block graphs outside the
  ops above (Inductor's fused kernels, graph entry and exit);
* ``forward, outside graphs``: the model forward outside the block graphs
  (embedding, final norm, the wrapper);
* ``logits``: ``compute_logits`` (LM head);
* ``runner and sampler``: the rest of the step (inputs, metadata, sampling,
  the scheduler), by difference.

The profiler inflates op-heavy parts, so the shares are applied to the
unprofiled step time. Run::

    scripts/test.sh -s perf -- step_budget.py [--batch 1 --batch 32] [--steps 32]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
sys.path.insert(0, str(Path(__file__).resolve().parent / "sxs"))

import proxies
import workloads as wl

GEMM_OPS = (
    "spyre_inference::onednn_linear_t",
    "spyre_inference::host_gemm_w16",
    "aten::mm",
    "aten::addmm",
)
ATTENTION_OP = "vllm::unified_attention_with_output"
KV_UPDATE_OP = "vllm::unified_kv_cache_update"
KERNEL_RANGES = (proxies.HOST_KERNEL, proxies.COMPILED)


def _inside(event: Any, names: tuple[str, ...]) -> bool:
    parent = event.cpu_parent
    while parent is not None:
        if parent.name.startswith(names):
            return True
        parent = parent.cpu_parent
    return False


def _budget(events: Any) -> dict[str, float]:
    """Microseconds per category over the profiled run."""
    us: dict[str, float] = dict.fromkeys(
        (
            "forward",
            "logits",
            "block graphs",
            "GEMM",
            "attention op",
            "kv update op",
            "attention kernels",
        ),
        0.0,
    )
    for e in events:
        name, t = e.name, e.cpu_time_total
        if name == proxies.FORWARD:
            us["forward"] += t
        elif name == proxies.LOGITS:
            us["logits"] += t
        elif name.startswith(proxies.COMPILED) and not _inside(e, (proxies.COMPILED,)):
            if _inside(e, (proxies.FORWARD,)):
                us["block graphs"] += t
        elif name.startswith(GEMM_OPS) and _inside(e, (proxies.COMPILED,)):
            if not _inside(e, GEMM_OPS) and not _inside(e, (proxies.LOGITS,)):
                us["GEMM"] += t
        elif name == ATTENTION_OP:
            us["attention op"] += t
        elif name == KV_UPDATE_OP:
            us["kv update op"] += t
        elif name.startswith(KERNEL_RANGES) and _inside(e, (ATTENTION_OP, KV_UPDATE_OP)):
            if not _inside(e, KERNEL_RANGES):
                us["attention kernels"] += t
    return us


def measure(llm: Any, prompts: list[list[int]], steps: int, runs: int) -> dict[str, float]:
    import torch
    from vllm import SamplingParams

    def generate(max_tokens: int) -> float:
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        t0 = time.perf_counter()
        llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        return time.perf_counter() - t0

    generate(1 + steps)  # warm-up
    step_ms = []
    for _ in range(runs):
        first = generate(1)
        step_ms.append((generate(1 + steps) - first) / steps * 1e3)
    step = statistics.median(step_ms)

    runner = llm.llm_engine.model_executor.driver_worker.worker.model_runner
    budgets = []
    for max_tokens in (1, 1 + steps):
        with (
            proxies.marked_ranges(runner),
            torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof,
        ):
            t0 = time.perf_counter()
            generate(max_tokens)
            wall = time.perf_counter() - t0
        budget = _budget(prof.events())
        budget["wall"] = wall * 1e6
        budgets.append(budget)
    # Decode steps only: the difference of the two profiled runs.
    d = {k: (budgets[1][k] - budgets[0][k]) / steps for k in budgets[0]}
    scale = step * 1e3 / d["wall"]  # profiled -> unprofiled microseconds
    graphs_rest = d["block graphs"] - d["GEMM"] - d["attention op"] - d["kv update op"]
    out = {
        "step (unprofiled)": step,
        "GEMM": d["GEMM"],
        "attention kernels": d["attention kernels"],
        "attention op, rest": d["attention op"] + d["kv update op"] - d["attention kernels"],
        "block graphs, rest": graphs_rest,
        "forward, outside graphs": d["forward"] - d["block graphs"],
        "logits": d["logits"],
        "runner and sampler": d["wall"] - d["forward"] - d["logits"],
    }
    return {k: (v if k == "step (unprofiled)" else v * scale / 1e3) for k, v in out.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, action="append", help="default: 1 and 32")
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--model", help="default: the prepared default model")
    args = parser.parse_args()
    if args.model is None:
        from spyre_inference.default_model import default_model_dir

        args.model = str(default_model_dir())
    import cpu_class
    from vllm import LLM

    llm = LLM(model=args.model, **wl.ENGINE_ARGS)
    batches = args.batch or [1, 32]
    cpu, flags = cpu_class.read_cpuinfo()
    print(f"CPU class `{cpu_class.classify(cpu, flags)['slug']}`; ms per decode step\n")
    rows = {}
    for b in batches:
        prompts = [p[:16] for p in wl.W2.prompts()][:b] if b > 1 else wl.W1.prompts()
        rows[b] = measure(llm, prompts, args.steps, args.runs)
    keys = list(next(iter(rows.values())))
    print("| part | " + " | ".join(f"batch {b}" for b in batches) + " |")
    print("|---|" + "---|" * len(batches))
    for k in keys:
        print(f"| {k} | " + " | ".join(f"{rows[b][k]:.2f}" for b in batches) + " |")
    llm.llm_engine.engine_core.shutdown()


if __name__ == "__main__":
    main()
