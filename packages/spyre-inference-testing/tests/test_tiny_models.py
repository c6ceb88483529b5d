"""The shared test helpers: tokenizer, tiny models, prompts and the HF greedy reference.

Everything here is checked against transformers and vLLM themselves: the models
must load in transformers, and vLLM's config parsing must see the values the
builder meant to set (rope theta, multipliers, sliding window, experts).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
import torch

from spyre_inference.testing import (
    BOS_TOKEN_ID,
    EOS_TOKEN_ID,
    KINDS,
    PAD_TOKEN_ID,
    TEST_PROMPTS,
    VOCAB_SIZE,
    assert_greedy_close,
    build_tiny_model,
    build_tokenizer,
    hf_greedy,
    hf_greedy_with_logprobs,
)

DECODERS = ["llama", "mistral", "granite", "granitemoe", "qwen3", "gemma3", "mixtral", "qwen3_moe"]
ENCODERS = ["bert", "roberta", "xlm-roberta"]


def _digests(folder: Path) -> dict[str, str]:
    return {f.name: hashlib.sha256(f.read_bytes()).hexdigest() for f in sorted(folder.iterdir())}


def test_kinds_cover_the_brief() -> None:
    assert set(DECODERS + ENCODERS) <= set(KINDS)


def test_tokenizer_is_deterministic_and_byte_level() -> None:
    first, second = build_tokenizer(), build_tokenizer()
    assert first.backend_tokenizer.to_str() == second.backend_tokenizer.to_str()
    assert len(first) == VOCAB_SIZE
    assert VOCAB_SIZE % 64, "vocab should not be stick-aligned, to exercise the padding paths"
    assert (first.pad_token_id, first.bos_token_id, first.eos_token_id) == (
        PAD_TOKEN_ID,
        BOS_TOKEN_ID,
        EOS_TOKEN_ID,
    )
    text = "Grüße, 東京! 12:30 €19.99 — naïve café\n\tdef f(): return 42"
    ids = first(text).input_ids
    assert ids[0] == BOS_TOKEN_ID
    assert first.decode(ids, skip_special_tokens=True) == text


def test_chat_template_renders_a_generation_prompt() -> None:
    tok = build_tokenizer()
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert text == "<|bos|><|user|>\nWhat is the capital of France?<|eos|>\n<|assistant|>\n"
    ids = tok(text, add_special_tokens=False).input_ids
    assert ids.count(BOS_TOKEN_ID) == 1 and ids.count(EOS_TOKEN_ID) == 1


def test_encoder_tokenizer_frames_pairs_with_token_types() -> None:
    tok = build_tokenizer("encoder")
    enc = tok("A man is eating.", "A man eats bread.")
    assert enc.input_ids[0] == BOS_TOKEN_ID and enc.input_ids[-1] == EOS_TOKEN_ID
    assert enc.input_ids.count(EOS_TOKEN_ID) == 2
    assert set(enc.token_type_ids) == {0, 1}
    assert enc.token_type_ids[0] == 0 and enc.token_type_ids[-1] == 1


def test_prompt_lengths_cross_kv_block_boundaries() -> None:
    tok = build_tokenizer()
    lengths = [len(tok(p).input_ids) for p in TEST_PROMPTS]
    assert len(lengths) >= 8
    assert min(lengths) <= 8
    assert any(48 <= n < 64 for n in lengths), lengths  # crosses 64 while generating
    assert any(100 <= n < 128 for n in lengths), lengths  # crosses 128 while generating
    assert max(lengths) >= 256, lengths  # several blocks; chunked prefill
    assert max(lengths) <= 512, lengths  # fits the tests' usual max_model_len


@pytest.mark.parametrize("kind", ["llama", "qwen3_moe", "roberta"])
def test_build_is_deterministic(kind: str, tmp_path: Path) -> None:
    a = build_tiny_model(kind, tmp_path / "a")
    b = build_tiny_model(kind, tmp_path / "b")
    assert _digests(a) == _digests(b)
    c = build_tiny_model(kind, tmp_path / "c", seed=1)
    assert _digests(c)["model.safetensors"] != _digests(a)["model.safetensors"]


@pytest.mark.parametrize("kind", DECODERS + ENCODERS)
def test_loads_in_transformers(kind: str, tiny_model_factory) -> None:
    from transformers import AutoConfig, AutoModel, AutoModelForCausalLM, AutoTokenizer

    path = tiny_model_factory(kind)
    config = AutoConfig.from_pretrained(path)
    assert config.dtype == torch.bfloat16
    assert config.vocab_size == len(AutoTokenizer.from_pretrained(path)) == VOCAB_SIZE
    assert config.hidden_size == 256 and config.num_hidden_layers == 2
    auto = AutoModelForCausalLM if kind in DECODERS else AutoModel
    model = auto.from_pretrained(path, dtype=torch.float32)
    assert type(model).__name__ == config.architectures[0]
    # Every stored value is a bfloat16 value, so float32 and bfloat16 runs share weights.
    for name, param in model.named_parameters():
        assert torch.equal(param, param.to(torch.bfloat16).float()), name


def test_overrides(tiny_model_factory) -> None:
    from transformers import AutoConfig, AutoModelForCausalLM

    path = tiny_model_factory(
        "llama", num_hidden_layers=3, head_dim=32, intermediate_size=200, num_key_value_heads=1
    )
    config = AutoConfig.from_pretrained(path)
    assert (config.num_hidden_layers, config.head_dim, config.intermediate_size) == (3, 32, 200)
    assert config.num_key_value_heads == 1
    model = AutoModelForCausalLM.from_pretrained(path)
    assert model.model.layers[0].self_attn.q_proj.weight.shape == (4 * 32, 256)
    with pytest.raises(ValueError, match="head_dim"):
        build_tiny_model("granite", path.parent / "bad", head_dim=32)


def test_tied_models_have_no_separate_lm_head(tiny_gemma3, tiny_llama) -> None:
    from safetensors import safe_open

    with safe_open(tiny_gemma3 / "model.safetensors", "pt") as f:
        assert not any(k.startswith("lm_head") for k in f.keys())
    with safe_open(tiny_llama / "model.safetensors", "pt") as f:
        assert "lm_head.weight" in f.keys()


@pytest.mark.parametrize("kind", DECODERS)
def test_greedy_outputs_are_not_degenerate(kind: str, tiny_model_factory) -> None:
    """Outputs depend on the prompt and do not collapse into one repeated token."""
    outputs = hf_greedy(tiny_model_factory(kind), TEST_PROMPTS, 12, "float32")
    assert all(len(o) == 12 for o in outputs)
    assert len({tuple(o) for o in outputs}) == len(TEST_PROMPTS)
    assert len({o[0] for o in outputs}) >= len(TEST_PROMPTS) // 2
    assert len({t for o in outputs for t in o}) >= 60
    repeats = sum(o[i] == o[i - 1] for o in outputs for i in range(1, len(o)))
    assert repeats <= 0.2 * sum(len(o) - 1 for o in outputs)


def test_hf_greedy_accepts_token_ids_and_matches_generate(tiny_qwen3) -> None:
    """The reference loop agrees with transformers' own generate() on greedy tokens."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_qwen3)
    prompts = list(TEST_PROMPTS[:3])
    ids = [tok(p).input_ids for p in prompts]
    ours = hf_greedy(tiny_qwen3, ids, 8, torch.float32)
    assert ours == hf_greedy(tiny_qwen3, prompts, 8, torch.float32)
    model = AutoModelForCausalLM.from_pretrained(tiny_qwen3, dtype=torch.float32)
    for prompt_ids, got in zip(ids, ours, strict=True):
        gen = model.generate(
            torch.tensor([prompt_ids]), max_new_tokens=8, do_sample=False, eos_token_id=None
        )
        generated = gen[0, len(prompt_ids) :].tolist()
        # generate() stops at eos; our loop (ignore_eos) continues.
        assert got[: len(generated)] == generated


def test_assert_greedy_close_tolerates_bf16_near_ties_only(tiny_llama) -> None:
    ref = hf_greedy_with_logprobs(tiny_llama, TEST_PROMPTS[:6], 16, torch.float32)
    assert assert_greedy_close(ref, [r.token_ids for r in ref]) == 6
    bf16 = hf_greedy(tiny_llama, TEST_PROMPTS[:6], 16, torch.bfloat16)
    assert_greedy_close(ref, bf16)  # rounding differences only: near ties
    broken = [[(t + 1) % VOCAB_SIZE for t in r.token_ids] for r in ref]
    with pytest.raises(AssertionError):
        assert_greedy_close(ref, broken)


def _vllm_config(path: Path):
    from vllm.transformers_utils.config import get_config

    return get_config(path, trust_remote_code=False)


@pytest.mark.parametrize(
    ("kind", "theta"),
    [("llama", 500000.0), ("granite", 300000.0), ("qwen3", 1e6), ("mixtral", 1e6)],
)
def test_vllm_reads_rope_theta(kind: str, theta: float, tiny_model_factory) -> None:
    # transformers 5 saves rope_parameters and no top-level rope_theta; vLLM
    # 0.33's layers read rope_parameters["rope_theta"].
    path = tiny_model_factory(kind)
    assert "rope_theta" not in json.loads((path / "config.json").read_text())
    assert _vllm_config(path).rope_parameters["rope_theta"] == theta


def test_vllm_reads_granite_multipliers(tiny_granite) -> None:
    config = _vllm_config(tiny_granite)
    assert (
        config.embedding_multiplier,
        config.residual_multiplier,
        config.attention_multiplier,
        config.logits_scaling,
    ) == (6.0, 0.5, 0.2, 2.5)


def test_vllm_reads_gemma3_layout(tiny_gemma3) -> None:
    config = _vllm_config(tiny_gemma3)
    assert config.layer_types == ["sliding_attention", "full_attention"]
    assert config.sliding_window == 48
    assert config.query_pre_attn_scalar == 32
    assert config.final_logit_softcapping == 10.0
    assert config.rope_parameters["sliding_attention"]["rope_theta"] == 10000.0
    assert config.rope_parameters["full_attention"]["rope_theta"] == 1e6


def test_vllm_reads_experts(tiny_mixtral, tiny_qwen3_moe) -> None:
    mixtral = _vllm_config(tiny_mixtral)
    assert (mixtral.num_local_experts, mixtral.num_experts_per_tok) == (4, 2)
    qwen = _vllm_config(tiny_qwen3_moe)
    # vLLM's qwen3_moe.py reads num_experts (an alias of num_local_experts in transformers 5).
    assert (qwen.num_experts, qwen.num_experts_per_tok, qwen.norm_topk_prob) == (4, 2, True)


@pytest.mark.parametrize(
    ("kind", "runner", "max_len"),
    [
        ("llama", "generate", 1024),
        ("gemma3", "generate", 1024),
        ("qwen3_moe", "generate", 1024),
        ("bert", "pooling", 1024),
        # vLLM takes max_position_embeddings as is and does not subtract
        # RoBERTa's pad offset (2 rows): pass max_model_len <= 1024 to engines.
        ("roberta", "pooling", 1026),
    ],
)
def test_vllm_model_config(kind: str, runner: str, max_len: int, tiny_model_factory) -> None:
    from vllm.config import ModelConfig

    config = ModelConfig(model=str(tiny_model_factory(kind)))
    assert config.dtype == torch.bfloat16
    assert config.runner_type == runner
    assert config.max_model_len == max_len
    assert config.get_head_size() == 64
    assert config.get_vocab_size() == VOCAB_SIZE
    if kind == "gemma3":
        assert config.get_sliding_window() == 48
