"""Helpers of the ops engine tests (run the plugin end to end, inspect the loaded model)."""

from __future__ import annotations

from typing import Any

#: vLLM classes the plugin swaps: none of them may survive in a loaded model.
UPSTREAM_SWAPPED = frozenset(
    {
        "ReplicatedLinear",
        "ColumnParallelLinear",
        "MergedColumnParallelLinear",
        "QKVParallelLinear",
        "RowParallelLinear",
        "ParallelLMHead",
        "LogitsProcessor",
        "VocabParallelEmbedding",
        "RotaryEmbedding",
        "Llama3RotaryEmbedding",
        "YaRNScalingRotaryEmbedding",
        "LinearScalingRotaryEmbedding",
        "NTKScalingRotaryEmbedding",
        "DynamicNTKScalingRotaryEmbedding",
        "DynamicNTKAlphaRotaryEmbedding",
        "Phi3LongRoPEScaledRotaryEmbedding",
        "Gemma4RotaryEmbedding",
        "RMSNorm",
        "GemmaRMSNorm",
        "GateLinear",
    }
)


def module_classes(llm: Any) -> dict[str, str]:
    """``{module name: class name}`` of the model loaded in the engine process."""
    (classes,) = llm.apply_model(
        lambda model: {n: type(m).__name__ for n, m in model.named_modules()}
    )
    return classes


def assert_all_swapped(classes: dict[str, str]) -> None:
    leftovers = {name: cls for name, cls in classes.items() if cls in UPSTREAM_SWAPPED}
    assert not leftovers, f"upstream layers left in the model: {leftovers}"
    spyre = {cls for cls in classes.values() if cls.startswith("Spyre")}
    for required in (
        "SpyreQKVParallelLinear",
        "SpyreRowParallelLinear",
        "SpyreMergedColumnParallelLinear",
        "SpyreVocabParallelEmbedding",
        "SpyreParallelLMHead",
        "SpyreLogitsProcessor",
    ):
        assert required in spyre, (required, sorted(spyre))


def greedy(llm: Any, prompts: Any, max_tokens: int) -> list[list[int]]:
    from vllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    return [list(o.outputs[0].token_ids) for o in llm.generate(list(prompts), params)]
