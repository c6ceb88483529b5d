"""MoE under tensor parallelism with an expert width that splits mid-stick.

Qwen3-MoE with ``moe_intermediate_size=192`` at ``tensor_parallel_size=2``:
each rank holds every expert's 96-wide slice, which the Spyre MoE backend
zero-widens to 128 (two whole 64-element sticks) at load. The widened columns
contribute nothing, and MoERunner all-reduces the per-rank partial sums, so
greedy tokens must equal Hugging Face's exactly in float32.
"""

from __future__ import annotations

from typing import Any

import pytest
from vllm import SamplingParams

from spyre_inference.testing import TEST_PROMPTS, hf_greedy

MAX_TOKENS = 16
PROMPTS = TEST_PROMPTS[:6]


@pytest.fixture(autouse=True)
def _allow_rpc_functions(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")


def _expert_shapes(worker: Any) -> list[tuple[list[int], list[int]]]:
    model = worker.model_runner.model
    return sorted(
        {
            (tuple(m.w13_weight.shape), tuple(m.w2_weight.shape))
            for m in model.modules()
            if hasattr(m, "w13_weight")
        }
    )


def test_tp2_mid_stick_expert_width_equals_hf(tiny_model_factory, make_llm) -> None:
    model = tiny_model_factory("qwen3_moe", moe_intermediate_size=192)
    want = hf_greedy(model, PROMPTS, MAX_TOKENS, "float32")
    llm = make_llm(model, dtype="float32", tensor_parallel_size=2, enforce_eager=True)
    # Per rank: w13 [E, H, 2 * 128], w2 [E, 128, H] (96 widened to 128).
    shapes = llm.collective_rpc(_expert_shapes)
    for rank_shapes in shapes:
        assert [tuple(map(tuple, pair)) for pair in rank_shapes] == [((4, 256, 256), (4, 128, 256))]
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    got = [list(o.outputs[0].token_ids) for o in llm.generate(list(PROMPTS), params)]
    mismatches = {i: (w, g) for i, (g, w) in enumerate(zip(got, want, strict=True)) if g != w}
    assert not mismatches
