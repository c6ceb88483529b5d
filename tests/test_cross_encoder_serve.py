"""`vllm serve` of BERT classifiers answers `/v1/score`, `/v1/rerank` and `/v1/classify`
like transformers.

A tiny random BERT sequence classifier with one label (the shape of
bge-reranker and ms-marco cross-encoders) is served in float32 by the
plugin. vLLM's score and rerank APIs tokenize each query with each document as
one pair (the document's tokens of type 1), run the classifier and take the
sigmoid of its logit; the reference does the same with transformers on the same
weights. Every score must be within 1e-3 of it, rerank must order the
documents by it and honour ``top_n``, and a malformed request (no query, a pair
longer than ``max_model_len``) gets an HTTP error while the server keeps answering.

A three-label classifier served the same way answers ``/v1/classify`` with the
softmax of transformers' logits (within 1e-3) and the label of the largest.

The openai client has no score or rerank calls, so these use HTTP directly,
as vLLM's own documentation does.
"""

from __future__ import annotations

import pytest
import requests

from spyre_inference.testing import hf_cross_encoder_scores
from tests.serving import serve

MODEL_NAME = "tiny-cross-encoder"
QUERY = "What is the capital of France?"
DOCUMENTS = [
    "Paris is the capital of France.",
    "The mitochondria is the powerhouse of the cell.",
    "Water boils at one hundred degrees at sea level.",
    "France borders Spain, Italy, Germany and Belgium.",
    "OK.",
]
TOLERANCE = 1e-3
#: Both servers (cross-encoder and classifier): float32, so the comparison is tight.
SERVER_ARGS = [
    "--served-model-name", MODEL_NAME,
    "--dtype", "float32",
    "--max-model-len", "256",
    "--max-num-seqs", "8",
    "--max-num-batched-tokens", "512",
]  # fmt: skip


@pytest.fixture(scope="module")
def cross_encoder(tiny_model_factory):
    return tiny_model_factory("bert", architecture="BertForSequenceClassification", num_labels=1)


@pytest.fixture(scope="module")
def server(cross_encoder):
    with serve(cross_encoder, SERVER_ARGS) as srv:
        yield srv


@pytest.fixture(scope="module")
def reference(cross_encoder) -> list[float]:
    return hf_cross_encoder_scores(cross_encoder, [QUERY] * len(DOCUMENTS), DOCUMENTS)


def _post(server, path: str, body: dict) -> requests.Response:
    return requests.post(server.url(path), json={"model": MODEL_NAME, **body}, timeout=120)


def test_v1_score_equals_transformers(server, reference) -> None:
    response = _post(server, "/v1/score", {"text_1": QUERY, "text_2": DOCUMENTS})
    assert response.status_code == 200, response.text
    data = sorted(response.json()["data"], key=lambda d: d["index"])
    got = [d["score"] for d in data]
    worst = max(abs(g - w) for g, w in zip(got, reference, strict=True))
    print(f"\n/v1/score: max |diff| {worst:.2e}")
    assert got == pytest.approx(reference, abs=TOLERANCE)
    # The reference scores are spread out, so equality within 1e-3 is informative.
    assert max(reference) - min(reference) > 20 * TOLERANCE, reference


def test_v1_rerank_orders_by_transformers_score(server, reference) -> None:
    response = _post(server, "/v1/rerank", {"query": QUERY, "documents": DOCUMENTS, "top_n": 3})
    assert response.status_code == 200, response.text
    results = response.json()["results"]
    want_order = sorted(range(len(DOCUMENTS)), key=lambda i: reference[i], reverse=True)[:3]
    assert [r["index"] for r in results] == want_order
    for r in results:
        assert r["relevance_score"] == pytest.approx(reference[r["index"]], abs=TOLERANCE)
        assert r["document"]["text"] == DOCUMENTS[r["index"]]


def test_malformed_rerank_is_an_http_error_and_the_server_keeps_serving(server, reference) -> None:
    missing = _post(server, "/v1/rerank", {"documents": DOCUMENTS})  # no query
    assert 400 <= missing.status_code < 500, missing.text
    too_long = _post(server, "/v1/rerank", {"query": QUERY, "documents": ["word " * 400]})
    assert 400 <= too_long.status_code < 500, too_long.text
    assert "256" in too_long.text  # names the model's limit
    good = _post(server, "/v1/score", {"text_1": QUERY, "text_2": DOCUMENTS[0]})
    assert good.status_code == 200, good.text
    assert good.json()["data"][0]["score"] == pytest.approx(reference[0], abs=TOLERANCE)
    assert requests.get(server.url("/health"), timeout=10).status_code == 200


CLASSIFY_INPUTS = ["Paris is the capital of France.", "OK.", "The old lighthouse stood still."]


@pytest.fixture(scope="module")
def classifier_server(tiny_model_factory):
    model = tiny_model_factory("bert", architecture="BertForSequenceClassification", num_labels=3)
    with serve(model, SERVER_ARGS) as srv:
        yield srv, model


def test_v1_classify_equals_transformers(classifier_server) -> None:
    import torch
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    server, model_dir = classifier_server
    response = _post(server, "/classify", {"input": CLASSIFY_INPUTS})
    assert response.status_code == 200, response.text
    data = sorted(response.json()["data"], key=lambda d: d["index"])

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForSequenceClassification.from_pretrained(model_dir, dtype=torch.float32)
    for text, item in zip(CLASSIFY_INPUTS, data, strict=True):
        with torch.inference_mode():
            want = torch.softmax(model.eval()(**tokenizer(text, return_tensors="pt")).logits[0], -1)
        assert item["num_classes"] == 3
        assert item["probs"] == pytest.approx(want.tolist(), abs=TOLERANCE)
        assert item["label"] == model.config.id2label[int(want.argmax())]
