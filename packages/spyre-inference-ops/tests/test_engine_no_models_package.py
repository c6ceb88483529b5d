"""The platform core and the ops package alone serve a Llama model.

The models package enters vLLM as the ``spyre_models`` general plugin; with
``VLLM_PLUGINS=spyre,spyre_ops`` the engine process loads only the platform
and the ops plugins (the attention backend is found through the core's own
entry-point group), which is what an install without the models distribution
looks like to vLLM. The model must still be served, swapped, and exact.
"""

from __future__ import annotations

import pytest

pytest.importorskip("spyre_inference.testing")

from ops_engine_util import assert_all_swapped, greedy, module_classes

from spyre_inference.testing import TEST_PROMPTS, hf_greedy


@pytest.fixture
def llm_in_process() -> bool:
    """Engines in their own process here: the subject is which plugins an engine
    process loads, and the test's process has loaded every installed one."""
    return False


MAX_TOKENS = 12


def test_llama_served_without_models_plugin(tiny_model_factory, make_llm, monkeypatch):
    monkeypatch.setenv("VLLM_PLUGINS", "spyre,spyre_ops")
    model = tiny_model_factory("llama")
    llm = make_llm(model, dtype="float32", enforce_eager=True)
    (loaded,) = llm.apply_model(
        lambda m: sorted(
            name for name in __import__("sys").modules if name.startswith("spyre_inference.")
        )
    )
    assert not any(name.startswith("spyre_inference.models") for name in loaded), loaded
    assert "spyre_inference.ops.linear" in loaded
    assert_all_swapped(module_classes(llm))
    prompts = TEST_PROMPTS[:3]
    assert greedy(llm, prompts, MAX_TOKENS) == hf_greedy(model, prompts, MAX_TOKENS, "float32")
