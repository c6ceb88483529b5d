"""Decoder checkpoints served as pooling models, against Hugging Face.

vLLM serves a causal LM as an embedding model with ``--convert embed`` (what
Qwen3-Embedding and e5-mistral-style checkpoints are run with): the model is
built through vLLM's pooling adapter, which keeps the LM head only as a
placeholder that is never loaded or run, and pools the last token's final
hidden state. A ``*ForSequenceClassification`` decoder (reward and classifier
heads on Llama / Qwen) goes through the same adapter with a score head.

Each runs on the Spyre decoder path (the swapped layers, the token-major
attention backend, compiled blocks) and is compared in float32 with the same
weights in transformers.
"""

from __future__ import annotations

import pytest
import torch

from spyre_inference.testing import TEST_PROMPTS

PROMPTS = list(TEST_PROMPTS[:4])


def _hf_last_token_states(model_dir, prompts) -> list[torch.Tensor]:
    """Normalized final hidden state of each prompt's last token (HF, float32)."""
    from transformers import AutoModel, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModel.from_pretrained(model_dir, dtype=torch.float32).eval()
    out = []
    for prompt in prompts:
        ids = tokenizer(prompt, return_tensors="pt").input_ids
        with torch.inference_mode():
            hidden = model(input_ids=ids).last_hidden_state[0, -1]
        out.append(torch.nn.functional.normalize(hidden, dim=-1))
    return out


# Qwen3 compiled, Llama eager: the adapter's placeholder head is met at load, before either.
@pytest.mark.parametrize(("kind", "eager"), [("qwen3", False), ("llama", True)])
def test_causal_lm_converted_to_embeddings_equals_hf(
    kind, eager, tiny_model_factory, make_llm
) -> None:
    model = tiny_model_factory(kind)
    want = _hf_last_token_states(model, PROMPTS)

    llm = make_llm(
        model,
        dtype="float32",
        enforce_eager=eager,
        runner="pooling",
        convert="embed",
        pooler_config={"seq_pooling_type": "LAST", "use_activation": True},
    )
    got = [torch.tensor(o.outputs.embedding) for o in llm.embed(PROMPTS)]
    assert len(got) == len(want)
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        torch.testing.assert_close(g, w, rtol=0, atol=1e-5, msg=f"prompt {i}")
    # Distinct prompts give distinct embeddings (the pooled row is each prompt's own).
    assert not torch.allclose(got[0], got[1], atol=1e-3)


def test_decoder_sequence_classifier_equals_hf(tiny_model_factory, make_llm) -> None:
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    model = tiny_model_factory("qwen3", architecture="Qwen3ForSequenceClassification", num_labels=3)
    tokenizer = AutoTokenizer.from_pretrained(model)
    hf = AutoModelForSequenceClassification.from_pretrained(model, dtype=torch.float32).eval()
    want = []
    for prompt in PROMPTS:
        ids = tokenizer(prompt, return_tensors="pt").input_ids
        with torch.inference_mode():
            want.append(torch.softmax(hf(input_ids=ids).logits[0], dim=-1))

    llm = make_llm(model, dtype="float32")
    got = [torch.tensor(o.outputs.probs) for o in llm.classify(PROMPTS)]
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        torch.testing.assert_close(g, w, rtol=0, atol=1e-5, msg=f"prompt {i}")
    assert not torch.allclose(got[0], got[1], atol=1e-4)
