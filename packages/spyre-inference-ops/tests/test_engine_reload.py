"""vLLM's in-place weight reload through the plugin's transposed-weight layers.

``reload_weights`` (the worker method RL weight-sync flows call) restores every
layer's checkpoint layout, loads into it and re-runs the post-load step. The
Spyre linear layers store their weight transposed, the LM head padded and
transposed; a reload that skipped the transpose computed silently with the
checkpoint matrix (a square ``o_proj`` accepts either) and lost the LM head's
matrix. Here a tiny float32 Llama is served compiled, *different* weights are
loaded in place and the greedy tokens must equal transformers on those weights;
reloading the first weights must give the first tokens back. Both head
variants: untied, and tied to the input embedding (the reload writes the
embedding only, so the head's transposed copy must follow it).
"""

from __future__ import annotations

import pytest

pytest.importorskip("spyre_inference.testing")

from ops_engine_util import greedy

from spyre_inference.testing import TEST_PROMPTS, hf_greedy

pytestmark = pytest.mark.slow

MAX_TOKENS = 10
PROMPTS = TEST_PROMPTS[:3]


@pytest.mark.parametrize("tied", [False, True], ids=["untied-head", "tied-head"])
def test_reload_weights_in_place_follows_the_new_weights(
    tied,
    tiny_model_factory,
    make_llm,
    monkeypatch,
):
    # Few buckets: the compiled path is what serving runs, its cost is start-up.
    monkeypatch.setenv("SPYRE_NUM_TOKENS_BUCKETS", "8,64")
    first_dir = tiny_model_factory("llama", tie_word_embeddings=tied, seed=11)
    other_dir = tiny_model_factory("llama", tie_word_embeddings=tied, seed=12)
    llm = make_llm(first_dir, dtype="float32")

    first = greedy(llm, PROMPTS, MAX_TOKENS)
    assert first == hf_greedy(first_dir, PROMPTS, MAX_TOKENS, "float32")

    llm.collective_rpc("reload_weights", kwargs={"weights_path": str(other_dir)})
    other = greedy(llm, PROMPTS, MAX_TOKENS)
    assert other != first, "the two checkpoints must not give the same tokens"
    assert other == hf_greedy(other_dir, PROMPTS, MAX_TOKENS, "float32")

    llm.collective_rpc("reload_weights", kwargs={"weights_path": str(first_dir)})
    assert greedy(llm, PROMPTS, MAX_TOKENS) == first
