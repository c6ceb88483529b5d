"""Engines shared by the feature tests, each started once for the whole folder.

Every engine start costs a process spawn, vLLM's import and (when compiled) the
warm-up compiles, so all feature modules share three engines (package scope:
started on first use, stopped after the folder's last test):

* ``main_llm``: the plugin as served, compiled (block graphs and attention
  kernels), float32 so that comparisons with transformers are exact, a
  64-token step budget so every prompt over 64 tokens is prefilled in chunks
  mixed with other sequences' decodes, prefix caching on (vLLM's default),
  ``max_model_len`` at the model's limit (512 positions) and a KV cache of 8
  blocks, small enough to force preemption when asked to.
* ``reference_llm``: the same model with the features under test switched
  off: no prefix caching and no chunking (a step budget of
  ``max_model_len``), eager, and vLLM's own sampler instead of the plugin's
  host sampler (``SPYRE_SAMPLER=vllm``).
* ``head_major_server``: ``vllm serve`` (OpenAI API) on the other decoder
  backend, head-major KV pages, eager (its attention kernels compile anyway).

Shapes are small on purpose (one num_tokens bucket, four sequences) so that
warm-up compiles few variants. Only ``main_llm`` turns statistics on in this
process (see :func:`tests.features.util.prometheus_counter`).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

from tests.features.util import (
    MAIN_ENV,
    MAIN_KWARGS,
    MAX_MODEL_LEN,
    MAX_NUM_SEQS,
    REFERENCE_ENV,
    REFERENCE_KWARGS,
    SERVED_NAME,
    STEP_BUDGET,
    running_llm,
)
from tests.serving import Server, serve


@pytest.fixture(scope="package")
def feature_model(tiny_model_factory) -> Path:
    """The tiny Llama of the test helpers with 512 positions instead of 1024."""
    return tiny_model_factory("llama", max_position_embeddings=MAX_MODEL_LEN)


@pytest.fixture(scope="package")
def main_llm(feature_model: Path) -> Iterator[Any]:
    with running_llm(feature_model, MAIN_ENV, **MAIN_KWARGS) as llm:
        yield llm


@pytest.fixture(scope="package")
def reference_llm(feature_model: Path) -> Iterator[Any]:
    with running_llm(feature_model, REFERENCE_ENV, **REFERENCE_KWARGS) as llm:
        yield llm


@pytest.fixture(scope="package")
def head_major_server(feature_model: Path) -> Iterator[Server]:
    args = [
        "--served-model-name", SERVED_NAME,
        "--dtype", "float32",
        "--max-model-len", str(MAX_MODEL_LEN),
        "--max-num-seqs", str(MAX_NUM_SEQS),
        "--max-num-batched-tokens", str(STEP_BUDGET),
        "--enforce-eager",
        # usage.prompt_tokens_details.cached_tokens: the per-request hit count
        "--enable-prompt-tokens-details",
        "--structured-outputs-config",
        '{"backend": "xgrammar", "disable_any_whitespace": true}',
    ]  # fmt: skip
    with serve(feature_model, args, env={"SPYRE_ATTN_KV_LAYOUT": "head_major"}) as server:
        yield server


@pytest.fixture(scope="package")
def head_major_client(head_major_server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=head_major_server.url("/v1"), api_key="unused")
