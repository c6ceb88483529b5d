"""vLLM's Ray executor on the cpu target: ranks as Ray actors on the ``spyre`` resource.

The test starts a one-node Ray cluster itself (``ray start --head``, stopped
after the module) and declares four ``spyre`` units on this 2-core host, as an
operator declares a node's units. ``LLM(distributed_executor_backend="ray")``
reaches it through ``RAY_ADDRESS``. Under it:

- TP=2: two Ray actors (the engine's process holds none), each a
  ``TorchSpyreWorker`` compiling its own blocks with the engine's ``SPYRE_*``
  settings (set after the cluster started); greedy tokens equal transformers'
  in float32 on every test prompt;
- a world size larger than the cluster's units is refused in the user's
  process, before an engine starts, with both numbers (vLLM alone would wait
  30 minutes for the placement group).

PP=2 under Ray, and `vllm serve` under Ray answering the OpenAI client, are in
``test_serve_engine_fault.py`` (with a local cluster vLLM starts itself).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import pytest
from vllm import SamplingParams

from spyre_inference.testing import TEST_PROMPTS, hf_greedy
from tests.ray_cluster import client_env, ray_cluster

ray = pytest.importorskip("ray")

MAX_TOKENS = 12
#: Units the test cluster declares: more than the host's 2 cores, so that the
#: refusal below is about the declared units, not about the CPU count.
UNITS = 4
#: A bucket set the workers know only from the engine's environment.
BUCKETS = "16,128"


@pytest.fixture(scope="module")
def ray_address() -> Iterator[str]:
    with ray_cluster(UNITS) as address:
        yield address


@pytest.fixture
def on_test_cluster(ray_address: str, monkeypatch: pytest.MonkeyPatch) -> str:
    for name, value in client_env(ray_address).items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
    return ray_address


def _where(worker: Any) -> dict[str, Any]:
    """Where a worker runs (process, Ray actor, the cluster's GCS) and its buckets."""
    import ray as worker_ray

    ctx = worker_ray.get_runtime_context()
    return {
        "pid": os.getpid(),
        "actor": ctx.get_actor_id(),
        "gcs": ctx.gcs_address,
        "runner": type(worker.model_runner).__name__,
        "buckets": list(worker.model_runner.token_buckets.sizes),
    }


def test_tp2_under_ray_greedy_equals_hf(
    tiny_model_factory, make_llm, on_test_cluster, monkeypatch
) -> None:
    # Set after the cluster started: the workers have it from the engine's process.
    monkeypatch.setenv("SPYRE_NUM_TOKENS_BUCKETS", BUCKETS)
    model = tiny_model_factory("llama", num_hidden_layers=3)
    want = hf_greedy(model, TEST_PROMPTS, MAX_TOKENS, "float32")
    llm = make_llm(
        model, dtype="float32", tensor_parallel_size=2, distributed_executor_backend="ray"
    )
    workers = llm.collective_rpc(_where)
    assert len({w["pid"] for w in workers}) == 2, workers
    assert all(w["actor"] for w in workers), workers
    # The test's cluster (Ray reports the GCS under the host's address).
    port = on_test_cluster.rsplit(":", 1)[1]
    assert {w["gcs"].rsplit(":", 1)[1] for w in workers} == {port}, workers
    assert {w["runner"] for w in workers} == {"TorchSpyreModelRunner"}, workers
    assert all(w["buckets"] == [int(b) for b in BUCKETS.split(",")] for w in workers), workers
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    got = [list(o.outputs[0].token_ids) for o in llm.generate(list(TEST_PROMPTS), params)]
    mismatches = {i: (w, g) for i, (g, w) in enumerate(zip(got, want, strict=True)) if g != w}
    assert not mismatches


def test_more_ranks_than_units_is_refused_before_the_engine_starts(
    tiny_llama, on_test_cluster
) -> None:
    from vllm import LLM

    # vLLM's config validation re-raises the platform's refusal as a ValueError.
    with pytest.raises(ValueError) as refused:
        LLM(
            model=str(tiny_llama),
            tensor_parallel_size=2,
            pipeline_parallel_size=4,
            distributed_executor_backend="ray",
        )
    message = str(refused.value)
    assert f"offers {UNITS} 'spyre' unit(s)" in message, message
    assert "= 8 ranks need 8" in message, message
    assert "ray start" in message, message
