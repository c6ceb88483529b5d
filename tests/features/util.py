"""Engine construction and small helpers shared by the feature tests."""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import pytest

from spyre_inference.platform import settings

#: The served-model name of ``head_major_server``.
SERVED_NAME = "tiny-llama-head-major"
#: The served-model name of ``main_llm``; its Prometheus counters carry it as a label.
MAIN_NAME = "feature-main"
#: The feature model's max_position_embeddings (the tiny Llama built with 512
#: positions: fewer KV-length buckets to compile than the default 1024).
MAX_MODEL_LEN = 512
STEP_BUDGET = 64
MAX_NUM_SEQS = 4
#: One num_tokens bucket (the step budget): the fewest block graphs to compile.
MAIN_ENV = {"SPYRE_NUM_TOKENS_BUCKETS": str(STEP_BUDGET)}

#: KV-cache blocks of ``main_llm`` (128 tokens each; vLLM keeps one as its null
#: block): 8 usable, two full-length sequences' worth. Enough for every check
#: that must not preempt (at most 7 blocks in use at once), too few for four
#: ~250-token sequences growing past 2 blocks each (the preemption check).
MAIN_KV_BLOCKS = 9

MAIN_KWARGS: dict[str, Any] = {
    "dtype": "float32",
    "max_model_len": MAX_MODEL_LEN,
    "max_num_seqs": MAX_NUM_SEQS,
    "max_num_batched_tokens": STEP_BUDGET,
    "served_model_name": MAIN_NAME,
    "num_gpu_blocks_override": MAIN_KV_BLOCKS,
    # Statistics on: Prometheus counters and per-request preemption counts.
    "disable_log_stats": False,
    # A random-weight model picks whitespace forever when a JSON grammar
    # allows it; vLLM's option (xgrammar backend only) bounds the output.
    "structured_outputs_config": {"backend": "xgrammar", "disable_any_whitespace": True},
}

#: The reference engine samples with vLLM's own PyTorch sampler (full sort), the
#: main one with the plugin's host sampler: the filter checks run on both.
REFERENCE_ENV = {"SPYRE_SAMPLER": "vllm"}

REFERENCE_KWARGS: dict[str, Any] = {
    "dtype": "float32",
    "max_model_len": MAX_MODEL_LEN,
    "max_num_seqs": MAX_NUM_SEQS,
    # No chunking: vLLM then needs a step budget of max_model_len, so every
    # prompt is prefilled in one step.
    "max_num_batched_tokens": MAX_MODEL_LEN,
    "enable_chunked_prefill": False,
    "enable_prefix_caching": False,
    "enforce_eager": True,
}


@contextlib.contextmanager
def running_llm(model: Path, env: Mapping[str, str] | None = None, **kwargs: Any) -> Iterator[Any]:
    """A ``vllm.LLM`` whose engine process starts with ``env`` set, shut down afterwards.

    The plugin's settings are read in the engine process when it starts, so
    ``env`` only has to be present while the engine is built; the parent's
    parsed-settings cache is cleared on both sides so it never keeps them.
    """
    from vllm import LLM

    with pytest.MonkeyPatch.context() as mp:
        for name, value in (env or {}).items():
            mp.setenv(name, value)
        settings.reset_cache()
        llm = LLM(model=str(model), **kwargs)
    settings.reset_cache()
    try:
        yield llm
    finally:
        llm.llm_engine.engine_core.shutdown()
        del llm
        gc.collect()


def greedy_params(max_tokens: int, **kwargs: Any) -> Any:
    from vllm import SamplingParams

    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **kwargs)


def token_ids(outputs: Sequence[Any]) -> list[list[int]]:
    """First completion's token ids of every request output."""
    return [list(o.outputs[0].token_ids) for o in outputs]


def preemptions(outputs: Sequence[Any]) -> list[int]:
    """How many times each request was preempted (needs statistics on)."""
    assert all(o.metrics is not None for o in outputs), "engine statistics are off"
    return [o.metrics.num_preemptions for o in outputs]


def prometheus_counter(name: str, model_name: str) -> float:
    """Value of vLLM counter ``name`` for the engine serving ``model_name``.

    Reads the process-wide Prometheus registry (what ``LLM.get_metrics`` reads).
    vLLM keeps one registry per process and every engine started with
    statistics on replaces the previous engine's counters in it, so this fails,
    rather than returning 0, when that engine's counters are no longer there.
    """
    from vllm.v1.metrics.reader import Counter, get_metrics_snapshot

    values = [
        m.value
        for m in get_metrics_snapshot()
        if isinstance(m, Counter) and m.name == name and m.labels.get("model_name") == model_name
    ]
    assert values, (
        f"no {name} counter for {model_name!r} in the Prometheus registry: another engine "
        "with statistics on was started after it"
    )
    return float(sum(values))
