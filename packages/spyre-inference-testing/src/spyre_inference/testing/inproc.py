"""In-process engines: the runner and torch's compile counters next to the test.

With ``VLLM_ENABLE_V1_MULTIPROCESSING=0`` vLLM runs the engine core, and so the
model runner, in the test's own process: a test can read the runner's compile
report and warm-up statistics and torch's global counters directly. Dynamo
keeps compiled graphs per code object for the whole process, so every engine
made here starts from ``torch._dynamo.reset()`` and cleared counters: without
that a second engine of the same architecture would find the first one's
graphs.
"""

from __future__ import annotations

from typing import Any


def runner_of(llm: Any) -> Any:
    """The model runner of an in-process ``vllm.LLM``."""
    return llm.llm_engine.model_executor.driver_worker.worker.model_runner


def scheduler_of(llm: Any) -> Any:
    """The scheduler of an in-process ``vllm.LLM`` (its engine core's)."""
    return llm.llm_engine.engine_core.engine_core.scheduler


def compiled_graphs() -> int:
    """Graphs Dynamo compiled in this process since the counters were cleared."""
    from torch._dynamo.utils import counters

    return counters["stats"]["unique_graphs"]


def inductor_calls() -> int:
    """Inductor graphs compiled or loaded from its FX graph cache since the last clear."""
    from torch._dynamo.utils import counters

    c = counters["inductor"]
    return c["fxgraph_cache_miss"] + c["fxgraph_cache_hit"] + c["fxgraph_cache_bypass"]


__all__ = ["compiled_graphs", "inductor_calls", "runner_of", "scheduler_of"]
