"""The Spyre cost proxies per decode step, counted on the emulated card.

Not a test: a measurement. On the cpu target the proxies (benchmarks/sxs/proxies.py)
are counted where the card *would* pay them; the cpu target also runs host
kernels the card never runs. On the emulated target the spyre target's own code
path runs (the card's attention forms, the compiled KV store), and the device
counts every transfer it actually makes, so the table holds both counts: the
conversion home's (``device.transfers``) and the device's own.

Run::

    scripts/test.sh -s perf -- emulated_proxies.py [--model DIR] [--steps 8] [--out FILE]

It sets ``SPYRE_DEVICE_TARGET=emulated`` and runs the engine in this process, in
float16 (the card's only dtype), on the prepared default model unless ``--model``.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any

os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
os.environ["SPYRE_DEVICE_TARGET"] = "emulated"
sys.path.insert(0, str(Path(__file__).resolve().parent / "sxs"))

import cpu_class
import proxies
import workloads as wl

KEYS = ("compiled_graph_calls", "eager_device_ops", "h2d", "d2h", "device_h2d", "device_d2h")


def _per_step(llm: Any, prompts: list[list[int]], steps: int) -> dict[str, float]:
    from spyre_inference.platform import emulated_card

    def run(max_tokens: int) -> dict[str, int]:
        before = emulated_card.transfer_counts()
        counts = proxies._profiled(llm, prompts, max_tokens)
        after = emulated_card.transfer_counts()
        counts["device_h2d"] = after[0] - before[0]
        counts["device_d2h"] = after[1] - before[1]
        return counts

    run(1 + steps)  # profiler warm-up
    prefill, full = run(1), run(1 + steps)
    return {k: round((full[k] - prefill[k]) / steps, 2) for k in KEYS}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="default: the prepared default model")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--batch", type=int, action="append", help="default: 1 and 4")
    parser.add_argument("--out", type=Path, help="write the markdown table here too")
    args = parser.parse_args()
    if args.model is None:
        from spyre_inference.default_model import default_model_dir

        args.model = str(default_model_dir())
    from vllm import LLM

    llm = LLM(
        model=args.model,
        dtype="float16",
        max_model_len=512,
        max_num_seqs=8,
        max_num_batched_tokens=128,
        kv_cache_memory_bytes=256 << 20,
    )
    rows = []
    for batch in args.batch or [1, 4]:
        prompts = [p[:16] for p in wl.Workload("proxies", batch, 16, 8, salt=7).prompts()]
        counts = _per_step(llm, prompts, args.steps)
        rows.append(f"| {batch} | " + " | ".join(f"{counts[k]:g}" for k in KEYS) + " |")
    table = "\n".join(
        [
            f"Emulated card, {Path(args.model).name}, float16, per decode step "
            f"({args.steps} steps; host: {cpu_class.classify(*cpu_class.read_cpuinfo())['label']})",
            "",
            "| batch | compiled graph calls | eager device ops | h2d (conversion home) "
            "| d2h (conversion home) | h2d (device) | d2h (device) |",
            "|---|---|---|---|---|---|---|",
            *rows,
        ]
    )
    print(table)
    if args.out:
        args.out.write_text(table + "\n")


if __name__ == "__main__":
    main()
