"""gpt-oss (bfloat16 weights): greedy output equals Hugging Face in float32.

A tiny random ``GptOssForCausalLM`` (saved in bfloat16, run in float32) has
everything the architecture adds: attention sinks (one learned logit per head
in every row's softmax), sliding-window layers alternating with full ones, q/k/v
and o biases, YaRN RoPE (not truncated), and MoE experts with biases, gate/up
rows interleaved and a clamped SwiGLU. vLLM builds it from its own model class
with the plugin's swaps (the attention sinks in the token-major backend, the
experts through the out-of-tree MoE method), compiled as served. Prompts run
from 5 to 354 tokens, past the window and across 128-token chunks.

The fixture's sinks matter to the tokens: transformers' own greedy output
changes when they are removed, so a backend that ignored them would fail.
"""

from __future__ import annotations

import torch

from spyre_inference.testing import TEST_PROMPTS, hf_greedy

MAX_TOKENS = 12
PROMPTS = (*TEST_PROMPTS[:4], TEST_PROMPTS[7], TEST_PROMPTS[9])


def _classes(model):
    return sorted({type(m).__name__ for m in model.modules()})


def _sinks_matter(model_dir, tmp_path) -> bool:
    """Whether transformers' greedy tokens change with the sinks pushed to -inf."""
    from safetensors.torch import load_file, save_file

    plain = tmp_path / "no-sinks"
    plain.mkdir()
    for item in model_dir.iterdir():
        if item.name != "model.safetensors":
            (plain / item.name).symlink_to(item)
    tensors = load_file(model_dir / "model.safetensors")
    for name in tensors:
        if name.endswith(".sinks"):
            tensors[name] = torch.full_like(tensors[name], -1e4)
    save_file(tensors, plain / "model.safetensors", metadata={"format": "pt"})
    return hf_greedy(plain, PROMPTS, MAX_TOKENS, "float32") != hf_greedy(
        model_dir, PROMPTS, MAX_TOKENS, "float32"
    )


def test_gpt_oss_greedy_equals_hf(tiny_model_factory, make_llm, tmp_path) -> None:
    from vllm import SamplingParams

    model = tiny_model_factory("gpt_oss")
    assert _sinks_matter(model, tmp_path)
    want = hf_greedy(model, PROMPTS, MAX_TOKENS, "float32")
    llm = make_llm(model, dtype="float32")
    (classes,) = llm.apply_model(_classes)
    assert "SpyreYaRNScalingRotaryEmbedding" in classes
    assert "SpyreUnquantizedFusedMoEMethod" in classes
    (sinks,) = llm.apply_model(
        lambda m: [x.impl.sinks is not None for x in m.modules() if type(x).__name__ == "Attention"]
    )
    assert sinks and all(sinks)

    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    got = [list(o.outputs[0].token_ids) for o in llm.generate(list(PROMPTS), params)]
    mismatches = {i: (w, g) for i, (g, w) in enumerate(zip(got, want, strict=True)) if g != w}
    assert not mismatches
