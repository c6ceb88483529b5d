"""Random request mixes with random arrival times through the plugin's engine.

The feature tests check each sampling parameter on fixed batches. Bugs that
depend on the schedule (which request is mid-prefill while which one samples,
when a request arrives) only show with other mixes: stop 15's CI run died on
one (a seeded request whose prompt was still being chunked next to a sampling
request; fixed in the platform's model runner). This tool drives vLLM's
in-process ``LLMEngine`` with random requests (random prompts, sampling
parameters, logprobs, penalties, ``n``, stop tokens), adds them at random steps
and fails on:

* any exception from the engine;
* a seeded request whose tokens differ from the same request run alone
  (vLLM's contract: a seed fixes the samples whatever shares the batch).

It is a tool, not a test: CI does not run it. Run it after touching the model
runner, the sampler path or the attention metadata, e.g.::

    python tools/fuzz_engine.py --seed 1 --trials 80

(a few minutes on 2 cores; a tiny random Llama is built on the fly with a
64-token step budget and a small KV cache, so chunking and preemption happen).

``--dtype bfloat16 --budget 512`` reaches the cpu target's bfloat16 attention
paths instead: prompts of up to ~450 tokens, some sharing a prefix (prefix
caching gives chunks a context), so steps mix decode-kernel rows, the
prefill-attention kernel's chunks and the graphs. Seeded requests are then not
compared with their runs alone: in 16-bit a product's rounding may depend on
how many rows share it (vLLM promises batch invariance in float32 only), so
that check is float32's.
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import tempfile
from pathlib import Path
from typing import Any

STEP_BUDGET = 64


def _params(rng: random.Random) -> Any:
    from vllm import SamplingParams

    p: dict[str, Any] = {
        "max_tokens": rng.choice([1, 2, 7, 16, 40]),
        "ignore_eos": rng.random() < 0.8,
    }
    if rng.random() < 0.7:
        p["temperature"] = rng.choice([0.5, 1.0, 1.5])
        p["seed"] = rng.choice([None, 1, 2, 3])
        if rng.random() < 0.5:
            p["top_k"] = rng.choice([1, 5, 50])
        if rng.random() < 0.5:
            p["top_p"] = rng.choice([0.1, 0.9])
        if rng.random() < 0.3:
            p["min_p"] = 0.05
        if rng.random() < 0.15:
            p["n"] = 2
    else:
        p["temperature"] = 0.0
    if rng.random() < 0.3:
        p["logprobs"] = rng.choice([0, 3, 20])
    if rng.random() < 0.2:
        p["prompt_logprobs"] = rng.choice([0, 2])
    if rng.random() < 0.2:
        p["repetition_penalty"] = 1.3
    if rng.random() < 0.2:
        p["presence_penalty"], p["frequency_penalty"] = 0.5, 0.3
    if rng.random() < 0.1:
        p["min_tokens"] = min(3, p["max_tokens"])
    if rng.random() < 0.1:
        p["stop_token_ids"] = [rng.randrange(0, 500)]
    if rng.random() < 0.1:
        p["logit_bias"] = {rng.randrange(0, 500): 5.0}
    return SamplingParams(**p)


def _long_prompts(rng: random.Random, short: list[list[int]], vocab: int) -> list[list[int]]:
    """Prompts of 150-450 tokens; each second one starts with an earlier one's first
    256 tokens, so prefix caching hands its chunks a context."""
    prompts: list[list[int]] = []
    for i in range(8):
        body = [rng.randrange(3, vocab) for _ in range(rng.randint(150, 450))]
        if i % 2 and prompts:
            body = prompts[-1][:256] + body[: rng.randint(8, 190)]
        prompts.append(body)
    return short + prompts


def _run(engine: Any, requests: list[tuple[str, list[int], Any]], rng: random.Random | None):
    """Finished outputs by request id; ``rng`` staggers the arrivals (None: all at once)."""
    pending = list(requests)
    outputs: dict[str, list[list[int]]] = {}
    while pending or engine.has_unfinished_requests():
        k = rng.randint(0, len(pending)) if rng else len(pending)
        for request_id, prompt, params in pending[:k]:
            engine.add_request(request_id, {"prompt_token_ids": prompt}, params)
        pending = pending[k:]
        if engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    outputs[out.request_id] = [list(c.token_ids) for c in out.outputs]
    return outputs


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seed", type=int, default=0, help="of the request generator")
    parser.add_argument("--trials", type=int, default=40)
    parser.add_argument("--model", help="a model folder (default: a tiny random Llama)")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    parser.add_argument(
        "--budget",
        type=int,
        default=STEP_BUDGET,
        help="tokens per step (the one num_tokens bucket unless SPYRE_NUM_TOKENS_BUCKETS is set)",
    )
    args = parser.parse_args()
    long_prompts = args.budget > STEP_BUDGET
    compare_alone = args.dtype == "float32"

    # In-process engine core (no engine subprocess), one num_tokens bucket.
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ.setdefault("SPYRE_NUM_TOKENS_BUCKETS", str(args.budget))
    from vllm.engine.arg_utils import EngineArgs
    from vllm.v1.engine.llm_engine import LLMEngine

    from spyre_inference.testing import TEST_PROMPTS, build_tiny_model

    with tempfile.TemporaryDirectory(prefix="spyre-fuzz-") as tmp:
        model = args.model or str(
            build_tiny_model("llama", Path(tmp) / "llama", max_position_embeddings=512)
        )
        engine = LLMEngine.from_engine_args(
            EngineArgs(
                model=model,
                dtype=args.dtype,
                max_model_len=512,
                max_num_seqs=4,
                max_num_batched_tokens=args.budget,
                # 128-token blocks: 8 usable, too few for four long sequences
                # (16 with long prompts: two of them fill 8).
                num_gpu_blocks_override=17 if long_prompts else 9,
            )
        )
        tokenizer = engine.get_tokenizer()
        prompts = [tokenizer.encode(p) for p in TEST_PROMPTS]
        rng = random.Random(args.seed)
        if long_prompts:
            prompts = _long_prompts(rng, prompts, engine.model_config.get_vocab_size())
        failures = 0
        for trial in range(args.trials):
            requests = [
                (f"t{trial}-{i}", rng.choice(prompts), _params(rng))
                for i in range(rng.randint(1, 6))
            ]
            try:
                outputs = _run(engine, requests, rng)
            except Exception:
                print(f"trial {trial}: the engine raised on {requests}", file=sys.stderr)
                raise
            for request_id, prompt, params in requests:
                if (
                    not compare_alone
                    or params.seed is None
                    or params.n != 1
                    or params.temperature == 0
                ):
                    continue
                alone = _run(engine, [(f"{request_id}-alone", prompt, params)], None)
                if alone[f"{request_id}-alone"] != outputs[request_id]:
                    failures += 1
                    print(
                        f"trial {trial}: seeded {request_id} ({len(prompt)} prompt tokens, "
                        f"{params}) gave {outputs[request_id]} in the mix, "
                        f"{alone[f'{request_id}-alone']} alone",
                        file=sys.stderr,
                    )
            print(f"trial {trial}: {len(requests)} requests ok", flush=True)
    from spyre_inference.attention.ops import host_decode, host_prefill

    # Which attention paths the trials reached (in-process engine: these counters
    # are the engine's): a run that never left the graphs fuzzed less than it says.
    print(
        f"host attention calls: decode kernel {host_decode.calls()}, prefill "
        f"{host_prefill.calls()} (of which the plugin's kernel {host_prefill.kernel_calls()})"
    )
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
