"""Engine start-up with compilation: cold vs warm Inductor cache, block vs model granularity.

Not a test: a measurement, for the embedded default model (SmolLM2-135M,
30 layers, prepared offline by ``spyre-prepare-default-model``).

Every start runs in a fresh Python process, as a server restart would, with
the engine in that process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``) so the child
can read the runner's compile report and torch's counters. For each
granularity (``SPYRE_COMPILE_GRANULARITY=block`` and ``model``):

* **cold**: an empty ``TORCHINDUCTOR_CACHE_DIR`` (Inductor generates and builds
  every graph);
* **warm**: the same directory again (Inductor's FX graph and AOTAutograd
  caches answer; Dynamo still traces each graph).

Reported per start: wall time of ``LLM(...)`` (load, profile, KV cache,
warm-up), the block/model warm-up alone, the number of compiled graphs
(Dynamo graphs of the compiled classes, per bucket and in total), torch's
process-wide ``unique_graphs`` (attention kernels included) and Inductor's
FX-graph-cache misses (real compiles) and hits (loaded). A greedy answer to
"What is the capital of France?" checks the engine works.

``--bucket-cost`` adds the per-step cost of small num_tokens buckets (the
question whether decode steps of 1..8 sequences should get buckets below 8):
the model forward (``_dummy_run``: blocks, embedding, final norm; attention
skipped) timed at 1, 2, 4, 8 and 16 tokens, with the worker's thread count and
with one thread (on a loaded machine, two OpenMP threads on two busy cores
spin against each other and the minimum of one thread is the steadier
figure).

Run::

    scripts/test.sh -s perf -- compile_startup.py [--bucket-cost]

Results go to ``benchmarks/results/compile_startup.{json,md}``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).resolve().parent / "results"
PROMPT = "What is the capital of France?"


def _child(args: argparse.Namespace) -> dict[str, Any]:
    """One engine start in this (fresh) process; returns the measurements."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    t_import = time.perf_counter()
    import torch
    from torch._dynamo.utils import counters
    from vllm import LLM, SamplingParams

    import_s = time.perf_counter() - t_import
    kwargs: dict[str, Any] = {
        "model": args.model,
        "max_model_len": args.max_model_len,
        "max_num_batched_tokens": args.max_num_batched_tokens,
        "max_num_seqs": args.max_num_seqs,
    }
    t0 = time.perf_counter()
    llm = LLM(**kwargs)
    start_s = time.perf_counter() - t0
    runner = llm.llm_engine.model_executor.driver_worker.worker.model_runner
    report, stats = runner.compile_report, runner.warm_up_stats
    inductor = counters["inductor"]
    graphs_at_start = counters["stats"]["unique_graphs"]

    params = SamplingParams(temperature=0.0, max_tokens=12)
    messages = [{"role": "user", "content": PROMPT}]
    t1 = time.perf_counter()
    answer = llm.chat(messages, params, use_tqdm=False)[0].outputs[0].text
    first_request_s = time.perf_counter() - t1
    result: dict[str, Any] = {
        "granularity": report.granularity,
        "buckets": list(runner.token_buckets.sizes),
        "import_s": round(import_s, 2),
        "engine_start_s": round(start_s, 2),
        "block_warm_up_s": round(stats.seconds, 2),
        "compiled_classes": report.classes,
        "graphs": report.artifacts(),
        "graphs_per_bucket": {
            n: g / len(runner.token_buckets.sizes) for n, g in report.artifacts().items()
        },
        "torch_unique_graphs": graphs_at_start,
        "inductor_compiled": inductor["fxgraph_cache_miss"],
        "inductor_from_cache": inductor["fxgraph_cache_hit"],
        "graphs_compiled_by_first_request": counters["stats"]["unique_graphs"] - graphs_at_start,
        "first_request_s": round(first_request_s, 2),
        "answer": answer,
        "torch_threads": torch.get_num_threads(),
    }
    if args.bucket_cost:
        result["bucket_cost_ms"] = _bucket_cost(runner, args.reps)
    llm.llm_engine.engine_core.shutdown()
    return result


def _bucket_cost(runner: Any, reps: int) -> dict[str, dict[str, float]]:
    """Model forward time per num_tokens bucket (min and median of ``reps``)."""
    import torch

    sizes = runner.token_buckets.sizes
    out: dict[str, dict[str, float]] = {}
    default_threads = torch.get_num_threads()
    for threads in sorted({default_threads, 1}, reverse=True):
        torch.set_num_threads(threads)
        times: dict[int, list[float]] = {n: [] for n in sizes}
        for n in sizes:
            runner._dummy_run(n, skip_eplb=True, remove_lora=False)
        # Interleaved, so a burst of load on the machine hits every size alike.
        for _ in range(reps):
            for n in sizes:
                t0 = time.perf_counter()
                runner._dummy_run(n, skip_eplb=True, remove_lora=False)
                times[n].append((time.perf_counter() - t0) * 1e3)
        for n in sizes:
            ts = sorted(times[n])
            out[f"threads={threads} num_tokens={n}"] = {
                "min": round(ts[0], 2),
                "median": round(ts[len(ts) // 2], 2),
            }
    torch.set_num_threads(default_threads)
    return out


def _run_child(
    args: argparse.Namespace, cache_dir: Path, granularity: str, buckets: str | None = None
) -> dict[str, Any]:
    env = dict(os.environ)
    env["TORCHINDUCTOR_CACHE_DIR"] = str(cache_dir)
    env["SPYRE_COMPILE_GRANULARITY"] = granularity
    if buckets is not None:
        env["SPYRE_NUM_TOKENS_BUCKETS"] = buckets
    cmd = [sys.executable, __file__, "--child", "--model", args.model]
    cmd += ["--max-model-len", str(args.max_model_len)]
    cmd += ["--max-num-batched-tokens", str(args.max_num_batched_tokens)]
    cmd += ["--max-num-seqs", str(args.max_num_seqs), "--reps", str(args.reps)]
    if buckets is not None:
        cmd.append("--bucket-cost")
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        sys.stderr.write(proc.stderr[-8000:])
        raise SystemExit(f"child failed ({granularity}): exit {proc.returncode}")
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    result["process_wall_s"] = round(wall, 2)
    result["load_average_after"] = [round(x, 1) for x in os.getloadavg()]
    return result


def _default_model() -> str:
    from spyre_inference.default_model import prepare_default_model

    return str(prepare_default_model())


def _markdown(data: dict[str, Any]) -> str:
    lines = [
        "# Compile start-up: embedded SmolLM2-135M (30 layers)",
        "",
        f"Measured {data['date']} on {data['machine']}; "
        f"max_model_len={data['config']['max_model_len']}, "
        f"max_num_batched_tokens={data['config']['max_num_batched_tokens']}, "
        f"max_num_seqs={data['config']['max_num_seqs']}, bfloat16, cpu target. "
        "Each start is a fresh process; cold = empty Inductor cache, warm = same cache again. "
        "Load averages show how busy the shared 2-core machine was.",
        "",
        "| granularity | start | engine start (s) | block/model warm-up (s) | graphs per bucket "
        "| graphs total | Inductor compiled | Inductor from cache | torch unique_graphs "
        "| compiles on 1st request | answer | load avg |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in data["runs"]:
        per_bucket = ", ".join(f"{n}: {g:g}" for n, g in row["graphs_per_bucket"].items())
        total = sum(row["graphs"].values())
        lines.append(
            f"| {row['granularity']} | {row['start']} | {row['engine_start_s']} "
            f"| {row['block_warm_up_s']} | {per_bucket} | {total} | {row['inductor_compiled']} "
            f"| {row['inductor_from_cache']} | {row['torch_unique_graphs']} "
            f"| {row['graphs_compiled_by_first_request']} | {row['answer'].strip()!r} "
            f"| {row['load_average_after'][0]} |"
        )
    lines.append("")
    lines.append(f"num_tokens buckets: {data['runs'][0]['buckets']}")
    cost = data.get("bucket_cost")
    if cost:
        lines += [
            "",
            "## Model forward per num_tokens bucket (ms; attention skipped)",
            "",
            "| threads, num_tokens | min | median |",
            "|---|---|---|",
        ]
        for key, v in cost["bucket_cost_ms"].items():
            lines.append(f"| {key} | {v['min']} | {v['median']} |")
        lines.append(f"\nload average after: {cost['load_average_after']}")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="model folder (default: embedded SmolLM2)")
    parser.add_argument("--max-model-len", type=int, default=1024)
    parser.add_argument("--max-num-batched-tokens", type=int, default=512)
    parser.add_argument("--max-num-seqs", type=int, default=16)
    parser.add_argument("--granularity", nargs="+", default=["block", "model"])
    parser.add_argument("--bucket-cost", action="store_true")
    parser.add_argument("--reps", type=int, default=40)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        result = _child(args)
        sys.stdout.write("\n" + json.dumps(result) + "\n")
        return

    args.model = args.model or _default_model()
    runs = []
    with tempfile.TemporaryDirectory(prefix="spyre-compile-bench-") as tmp:
        for granularity in args.granularity:
            cache = Path(tmp) / f"inductor-{granularity}"
            for start in ("cold", "warm"):
                print(f"{granularity} {start} start ...", file=sys.stderr, flush=True)
                row = _run_child(args, cache, granularity)
                row["start"] = start
                runs.append(row)
                print(json.dumps(row), file=sys.stderr, flush=True)
        cost = None
        if args.bucket_cost:
            print("bucket cost ...", file=sys.stderr, flush=True)
            cost_args = argparse.Namespace(**{**vars(args), "max_num_batched_tokens": 16})
            cost = _run_child(cost_args, Path(tmp) / "inductor-block", "block", "1,2,4,8,16")
    data = {
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "machine": f"{platform.machine()}, {os.cpu_count()} cores",
        "config": {
            "model": args.model,
            "max_model_len": args.max_model_len,
            "max_num_batched_tokens": args.max_num_batched_tokens,
            "max_num_seqs": args.max_num_seqs,
        },
        "runs": runs,
        "bucket_cost": cost,
    }
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "compile_startup.json").write_text(json.dumps(data, indent=2) + "\n")
    (RESULTS / "compile_startup.md").write_text(_markdown(data))
    print(_markdown(data))


if __name__ == "__main__":
    main()
