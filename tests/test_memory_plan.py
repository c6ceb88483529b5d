"""The cpu target's host-memory plan covers what warm-up and serving really use.

Issue 21: with a 262,144-token vocabulary in float32 the KV budget (a share of
the host with no headroom) left warm-up too little and the kernel OOM-killed
the engine. The worker now keeps a reserve for warm-up and the largest step
(``spyre_inference.platform.memory_plan``). Here a model with that vocabulary
serves a full batch of ``max_num_seqs`` requests with logprobs, so the step's
float32 logits (256 rows x 262,144) are the largest transient, and the engine
process's measured peak RSS must stay within what the plan accounted for:
its RSS when it planned, plus the KV cache, plus the reserve.
"""

from __future__ import annotations

import pytest
from vllm import SamplingParams

from spyre_inference.platform.memory_plan import GiB, plan_host_kv

VOCAB = 262_144
SEQS = 256


def test_plan_covers_the_measured_peak_with_a_262k_vocabulary(tiny_model_factory, make_llm):
    model = tiny_model_factory("gemma3", vocab_size=VOCAB)
    llm = make_llm(model, dtype="float32", max_num_seqs=SEQS, max_num_batched_tokens=512)
    prompts = [f"Request {i}: tell me about the number {i}." for i in range(SEQS)]
    params = SamplingParams(temperature=0.0, max_tokens=3, logprobs=5, ignore_eos=True)
    outputs = llm.generate(prompts, params)
    assert all(len(o.outputs[0].token_ids) == 3 for o in outputs)
    (report,) = llm.collective_rpc("memory_report")
    plan = report["plan"]
    accounted = plan["worker_rss"] + plan["kv_bytes"] + report["reserve_bytes"]
    print(
        f"\nplan: RSS {plan['worker_rss'] / GiB:.2f} GiB + KV {plan['kv_bytes'] / GiB:.2f} + "
        f"reserve {report['reserve_bytes'] / GiB:.2f} "
        f"({ {k: round(v / GiB, 3) for k, v in plan['reserve'].items()} }) = "
        f"{accounted / GiB:.2f} GiB; measured peak {report['peak_rss'] / GiB:.2f} GiB"
    )
    assert plan["reserve"]["logits"] >= SEQS * VOCAB * 4
    assert report["peak_rss"] <= accounted


def test_a_cache_that_cannot_hold_one_sequence_is_refused_with_the_numbers() -> None:
    reserve = {"activations": GiB // 4, "logits": 3 * GiB, "compile": GiB}
    host = {"total": 24 * GiB, "worker_rss": 2 * GiB, "utilization": 0.9, "reserve": reserve,
            "full_batch_kv": 40 * GiB, "one_sequence_kv": GiB}  # fmt: skip
    with pytest.raises(ValueError) as refused:
        plan_host_kv(available=5 * GiB, **host)
    message = str(refused.value)
    # What it needs, what is available, what the reserve is made of, and the flags.
    for needle in ("needs 1.00 GiB", "5.00 GiB available", "4.25 GiB", "logits 3.00",
                   "--max-model-len", "--kv-cache-memory-bytes", "--dtype"):  # fmt: skip
        assert needle in message, (needle, message)
    plan = plan_host_kv(available=20 * GiB, **host)
    # The user's share would allow 19.6 GiB; the reserve caps the cache first.
    assert plan.kv_bytes == 20 * GiB - plan.reserve_bytes
