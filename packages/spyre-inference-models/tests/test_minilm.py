"""all-MiniLM-L6-v2 (BERT, 6 layers, 12 heads of 32) through ``LLM.embed``.

The reference is the folder's sentence-transformers pipeline (mean pooling,
normalisation) computed in float32 with Hugging Face transformers, and checked
against sentence-transformers itself when it is installed. vLLM
reads the folder's ``modules.json`` (mean pooling, normalisation) and, for a
float32 checkpoint of a pooling model, picks float16 by default; the
encoder attention backend pads MiniLM's 32-wide heads to a whole stick. Every
one of the 20 sentences must have cosine >= 0.99 with the reference, and the
model card's pair must keep its similarity (about 0.755).
"""

from __future__ import annotations

import pytest
import torch
from minilm_data import (
    REFERENCE_COSINE,
    REFERENCE_PAIR,
    SENTENCES,
    minilm_path,
    reference_embeddings,
)


@pytest.mark.parametrize("eager", [True, False], ids=["eager", "compiled"])
def test_minilm_embed_matches_sentence_transformers(eager, make_llm, monkeypatch) -> None:
    path = minilm_path()
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    want = reference_embeddings(path, SENTENCES)
    llm = make_llm(path, max_model_len=256, max_num_batched_tokens=512, enforce_eager=eager)
    got = torch.tensor([o.outputs.embedding for o in llm.embed(SENTENCES)])
    assert got.shape == want.shape == (20, 384)
    cosines = torch.nn.functional.cosine_similarity(got, want, dim=-1)
    mode = "eager" if eager else "compiled"
    print(f"\nMiniLM LLM.embed ({mode}): min cosine {cosines.min():.6f} over 20 sentences")
    assert cosines.min() >= 0.99, cosines.tolist()

    a, b = (SENTENCES.index(s) for s in REFERENCE_PAIR)
    pair = float(torch.nn.functional.cosine_similarity(got[a], got[b], dim=0))
    ref_pair = float(want[a] @ want[b])
    print(f"reference pair cosine {pair:.4f} (reference pipeline {ref_pair:.4f})")
    assert pair == pytest.approx(REFERENCE_COSINE, abs=0.01)
    assert pair == pytest.approx(ref_pair, abs=0.005)
