"""Tiny random Hugging Face checkpoints for tests, built offline in seconds.

:func:`build_tiny_model` writes a complete model folder (``config.json``,
``model.safetensors``, tokenizer files, chat template) that both vLLM and
transformers load, so a test can run the plugin and a Hugging Face reference on
the same weights without any download.

Choices and why
---------------
* **Saved in bfloat16.** Weights are drawn in float32 and rounded once to
  bfloat16 before saving. Every stored value is then exactly representable in
  bfloat16 *and* float32, so a float32 run and a bfloat16 run (the cpu target's
  default compute dtype) start from identical parameters, and a float32 HF
  reference is the exact-weights ground truth for either. ``config.json``
  records ``"dtype": "bfloat16"``, which is what vLLM's ``dtype="auto"`` picks.
  Pass ``dtype=torch.float32`` to save float32 instead.
* **Our own deterministic initialisation, not transformers' ``_init_weights``.**
  Each parameter is drawn from a generator seeded by ``(seed, parameter
  name)``, so weights do not depend on module construction order or on how a
  transformers release initialises a class. Scales are chosen so greedy
  decoding is *not* degenerate (transformers' default std of 0.02 makes every
  layer's output tiny next to the residual stream, so the next token depends
  almost only on the current one and all prompts fall into the same short
  loops):

  - matrices: ``N(0, 1/fan_in)`` (variance preserving): q, k and v are about
    unit scale, so attention scores have a standard deviation near one and the
    attention pattern is neither uniform nor one-hot; attention and MLP outputs
    are about as large as the embedding, so context really changes the output;
  - token embeddings: unit scale as seen by the first layer (divided by Gemma's
    ``sqrt(hidden)`` input scale and Granite's ``embedding_multiplier``);
  - norm weights: their usual value (1, or 0 for Gemma's ``1 + w`` norms) plus
    ``N(0, 0.1)``, and biases ``N(0, 0.1)``: a kernel that drops a norm weight
    or a bias gives visibly different tokens;
  - attention sinks (gpt-oss): ``3 + N(0, 1)``, a real share of every row's
    softmax;
  - the (untied) LM head: ``N(0, 4/hidden)``, logits with a standard deviation
    of about 2, so the top-1 margin is usually well above bfloat16 noise.

  ``tests/test_testing_models.py`` checks with HF greedy decoding that outputs
  differ across the test prompts and use many distinct tokens.
* **Non-default values for what kernels can get wrong silently**: rope theta
  differs from transformers' and vLLM's defaults, Granite's four multipliers
  are not 1, Gemma 3 has ``query_pre_attn_scalar != head_dim``, a sliding
  window shorter than the long test prompts and a final logit soft-cap.
"""

from __future__ import annotations

import dataclasses
import math
import os
import zlib
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from spyre_inference.testing.tokenizer import (
    BOS_TOKEN_ID,
    EOS_TOKEN_ID,
    PAD_TOKEN_ID,
    VOCAB_SIZE,
    TokenizerStyle,
    save_tokenizer,
)

#: Increment when a change here changes the bytes of a built model.
BUILDER_VERSION = 1

DEFAULT_DTYPE = torch.bfloat16
DEFAULT_SEED = 0


@dataclasses.dataclass(frozen=True)
class TinyModelKind:
    """How to build one architecture: HF model type, class, and config defaults."""

    model_type: str
    architecture: str
    tokenizer_style: TokenizerStyle
    config: Mapping[str, Any]
    #: Whether the HF config has an independent ``head_dim`` field; when not,
    #: head_dim is hidden_size // num_attention_heads.
    has_head_dim: bool = True
    is_decoder: bool = True


_DECODER_COMMON: dict[str, Any] = {
    "hidden_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "intermediate_size": 512,
    "max_position_embeddings": 1024,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False,
}

_ENCODER_COMMON: dict[str, Any] = {
    "hidden_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "intermediate_size": 512,
    "max_position_embeddings": 1024,
    # Two segment types so cross-encoder / pair inputs carry real token_type_ids.
    "type_vocab_size": 2,
    "hidden_dropout_prob": 0.0,
    "attention_probs_dropout_prob": 0.0,
}


#: Granite's multipliers, every one away from 1 (and attention_multiplier from
#: 1/sqrt(head_dim) = 0.125) so that a path ignoring any of them produces
#: different tokens.
_GRANITE_MULTIPLIERS: dict[str, Any] = {
    "embedding_multiplier": 6.0,
    "residual_multiplier": 0.5,
    "attention_multiplier": 0.2,
    "logits_scaling": 2.5,
}


def _rope(theta: float) -> dict[str, Any]:
    return {"rope_type": "default", "rope_theta": theta}


KINDS: dict[str, TinyModelKind] = {
    "llama": TinyModelKind(
        "llama",
        "LlamaForCausalLM",
        "decoder",
        # Llama-3's theta, not the 10000 default, so a reader that falls back
        # to a default is caught.
        {**_DECODER_COMMON, "rope_parameters": _rope(500000.0)},
    ),
    "granite": TinyModelKind(
        "granite",
        "GraniteForCausalLM",
        "decoder",
        {
            **_DECODER_COMMON,
            "rope_parameters": _rope(300000.0),
            **_GRANITE_MULTIPLIERS,
        },
        has_head_dim=False,
    ),
    # Mistral 7B v0.2+ / Nemo / Small: Llama's layers under vLLM's own Mistral
    # classes; no sliding window (v0.1's 4096 window is gone from later releases).
    "mistral": TinyModelKind(
        "mistral",
        "MistralForCausalLM",
        "decoder",
        {**_DECODER_COMMON, "rope_parameters": _rope(1000000.0), "sliding_window": None},
    ),
    "qwen3": TinyModelKind(
        "qwen3",
        "Qwen3ForCausalLM",
        "decoder",
        {**_DECODER_COMMON, "rope_parameters": _rope(1000000.0)},
    ),
    "qwen2": TinyModelKind(
        # Biased q/k/v projections; head_dim derived from hidden / heads.
        "qwen2",
        "Qwen2ForCausalLM",
        "decoder",
        {**_DECODER_COMMON, "rope_parameters": _rope(1000000.0)},
        has_head_dim=False,
    ),
    "phi3": TinyModelKind(
        # Fused qkv_proj / gate_up_proj on disk; head_dim 32 (hidden / heads), so
        # off the 64-element stick. Pass rope_parameters (longrope) and
        # original_max_position_embeddings for Phi-3's long-context RoPE.
        "phi3",
        "Phi3ForCausalLM",
        "decoder",
        {**_DECODER_COMMON, "num_attention_heads": 8, "rope_parameters": _rope(10000.0)},
        has_head_dim=False,
    ),
    # StableLM 2: LayerNorm, RoPE on the leading quarter of each head (partial
    # rotary, the ops package's pair form); head_dim from hidden / heads.
    "stablelm": TinyModelKind(
        "stablelm",
        "StableLmForCausalLM",
        "decoder",
        {**_DECODER_COMMON, "rope_parameters": _rope(10000.0), "partial_rotary_factor": 0.25},
        has_head_dim=False,
    ),
    # GLM-4: vLLM builds its RoPE GPT-J-style (interleaved pairs) over half of
    # each head (partial): the pair form's other two variations at once.
    "glm4": TinyModelKind(
        "glm4",
        "Glm4ForCausalLM",
        "decoder",
        {
            **_DECODER_COMMON,
            "rope_parameters": {**_rope(10000.0), "partial_rotary_factor": 0.5},
        },
    ),
    "gemma3": TinyModelKind(
        "gemma3_text",
        "Gemma3ForCausalLM",
        "decoder",
        {
            **_DECODER_COMMON,
            "tie_word_embeddings": True,
            "hidden_activation": "gelu_pytorch_tanh",
            # Scaling 32**-0.5 instead of head_dim**-0.5.
            "query_pre_attn_scalar": 32,
            # Shorter than the long test prompts, so the window is exercised;
            # layer_types (sliding on even layers) is filled in by the builder.
            "sliding_window": 48,
            "rope_parameters": {
                "sliding_attention": _rope(10000.0),
                "full_attention": _rope(1000000.0),
            },
            # Applied by both HF and vLLM (LogitsProcessor soft_cap). It never
            # changes greedy tokens (tanh is monotonic) but changes logprobs.
            "final_logit_softcapping": 10.0,
            # Left off by default: HF's Gemma 3 applies it, but vLLM 0.33's
            # gemma3.py ignores the field, so HF and vLLM would disagree. Pass
            # attn_logit_softcapping=... to build a model that has it.
            "attn_logit_softcapping": None,
        },
    ),
    "gemma2": TinyModelKind(
        "gemma2",
        "Gemma2ForCausalLM",
        "decoder",
        {
            **_DECODER_COMMON,
            "tie_word_embeddings": True,
            "hidden_activation": "gelu_pytorch_tanh",
            "query_pre_attn_scalar": 32,
            # layer_types (sliding on even layers) is filled in by the builder.
            "sliding_window": 48,
            "rope_parameters": _rope(10000.0),
            # Gemma 2's own caps: both HF and vLLM apply them.
            "attn_logit_softcapping": 50.0,
            "final_logit_softcapping": 30.0,
        },
    ),
    "mixtral": TinyModelKind(
        "mixtral",
        "MixtralForCausalLM",
        "decoder",
        {
            **_DECODER_COMMON,
            "rope_parameters": _rope(1000000.0),
            "num_local_experts": 4,
            "num_experts_per_tok": 2,
        },
    ),
    # Granite 3.x MoE (granite-3.1-1b-a400m, 3b-a800m): Granite's multipliers
    # (all away from 1, as for the dense kind) with routed experts.
    "granitemoe": TinyModelKind(
        "granitemoe",
        "GraniteMoeForCausalLM",
        "decoder",
        {
            **_DECODER_COMMON,
            "rope_parameters": _rope(10000.0),
            "num_local_experts": 4,
            "num_experts_per_tok": 2,
            **_GRANITE_MULTIPLIERS,
        },
        has_head_dim=False,
    ),
    # Falcon-RW style: ALiBi position biases instead of RoPE, parallel attention
    # and MLP, LayerNorm with biases, tied embeddings. Falcon's own config keys
    # (Llama-style ones such as num_key_value_heads would read as GQA).
    "falcon": TinyModelKind(
        "falcon",
        "FalconForCausalLM",
        "decoder",
        {
            "hidden_size": 256,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "max_position_embeddings": 1024,
            "new_decoder_architecture": False,
            "multi_query": False,
            "alibi": True,
            "parallel_attn": True,
            "bias": True,
            "tie_word_embeddings": True,
            "hidden_dropout": 0.0,
            "attention_dropout": 0.0,
        },
        has_head_dim=False,
    ),
    "qwen3_moe": TinyModelKind(
        "qwen3_moe",
        "Qwen3MoeForCausalLM",
        "decoder",
        {
            **_DECODER_COMMON,
            "rope_parameters": _rope(1000000.0),
            "num_experts": 4,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 256,
            "norm_topk_prob": True,
            "decoder_sparse_step": 1,
        },
    ),
    "gpt_oss": TinyModelKind(
        "gpt_oss",
        "GptOssForCausalLM",
        "decoder",
        {
            **_DECODER_COMMON,
            # Sliding (even) and full (odd) layers alternate, as in gpt-oss; the
            # window is shorter than the long test prompts.
            "sliding_window": 48,
            "num_local_experts": 4,
            "num_experts_per_tok": 2,
            "intermediate_size": 192,
            # gpt-oss's YaRN recipe (not truncated), scaled down to the tiny
            # model's 1024 positions.
            "rope_parameters": {
                "rope_type": "yarn",
                "rope_theta": 150000.0,
                "factor": 16.0,
                "beta_fast": 32.0,
                "beta_slow": 1.0,
                "truncate": False,
                "original_max_position_embeddings": 64,
            },
        },
    ),
    "granitemoehybrid": TinyModelKind(
        "granitemoehybrid",
        "GraniteMoeHybridForCausalLM",
        "decoder",
        {
            **{k: v for k, v in _DECODER_COMMON.items() if k != "head_dim"},
            "num_hidden_layers": 4,
            # Granite 4's hybrid stack: Mamba2 mixers with one attention layer
            # between them, no position embedding (Granite-4.0-H's "nope").
            "layer_types": [
                "linear_attention",
                "full_attention",
                "linear_attention",
                "linear_attention",
            ],
            "position_embedding_type": None,
            # Mamba2 sizes off the 64-element stick (head 32, state 48) and a
            # scan chunk unlike the plugin's own. One group, as in Granite 4's
            # checkpoints: with more, vLLM's gated norm normalises per group
            # and transformers' over the whole width, so the two references
            # disagree with each other.
            "mamba_n_heads": 16,
            "mamba_d_head": 32,
            "mamba_d_state": 48,
            "mamba_n_groups": 1,
            "mamba_d_conv": 4,
            "mamba_expand": 2,
            "mamba_chunk_size": 128,
            # Dense: the shared MLP alone (num_local_experts=4 makes the MoE variant).
            "num_local_experts": 0,
            "shared_intermediate_size": 320,
            "intermediate_size": 160,
            "embedding_multiplier": 6.0,
            "residual_multiplier": 0.5,
            "attention_multiplier": 0.2,
            "logits_scaling": 2.5,
        },
        has_head_dim=False,
    ),
    "bert": TinyModelKind(
        "bert", "BertModel", "encoder", _ENCODER_COMMON, has_head_dim=False, is_decoder=False
    ),
    "roberta": TinyModelKind(
        "roberta",
        "RobertaModel",
        "encoder",
        {
            **_ENCODER_COMMON,
            # RoBERTa positions start at pad_token_id + 1 (= 1 here), so 1024
            # usable positions need 1025 rows; 1026 mirrors the real 512 + 2.
            "max_position_embeddings": 1026,
        },
        has_head_dim=False,
        is_decoder=False,
    ),
}
# XLM-RoBERTa (multilingual encoders, bge-m3, bge-reranker): RoBERTa's layers
# and position offset under its own model type and classes. Published
# checkpoints' config.json carries ``position_embedding_type`` (vLLM 0.33 reads
# it for every XLMRobertaModel, to tell Jina's rotary variant apart), which
# transformers 5 no longer writes by default: set it as they do.
KINDS["xlm-roberta"] = dataclasses.replace(
    KINDS["roberta"],
    model_type="xlm-roberta",
    architecture="XLMRobertaModel",
    config={**KINDS["roberta"].config, "position_embedding_type": "absolute"},
)


def _config_kwargs(spec: TinyModelKind, overrides: Mapping[str, Any]) -> dict[str, Any]:
    """Merge kind defaults with overrides and derive the dependent fields."""
    kwargs: dict[str, Any] = dict(spec.config)
    kwargs.update(
        vocab_size=VOCAB_SIZE,
        pad_token_id=PAD_TOKEN_ID,
        bos_token_id=BOS_TOKEN_ID,
        eos_token_id=EOS_TOKEN_ID,
    )
    overrides = dict(overrides)
    # Convenience: rope_theta=... sets the theta of the (single) rope config.
    if "rope_theta" in overrides:
        theta = float(overrides.pop("rope_theta"))
        rope = kwargs.get("rope_parameters")
        if rope is None or "rope_theta" not in rope:
            raise ValueError(f"rope_theta override is ambiguous for {spec.model_type}")
        kwargs["rope_parameters"] = {**rope, "rope_theta": theta}
    kwargs.update(overrides)

    heads = kwargs["num_attention_heads"]
    if not spec.has_head_dim:
        kwargs.pop("head_dim", None)
        if "head_dim" in overrides:
            raise ValueError(
                f"{spec.model_type} derives head_dim from hidden_size / num_attention_heads; "
                "override hidden_size or num_attention_heads instead"
            )
        if kwargs["hidden_size"] % heads:
            raise ValueError(f"hidden_size {kwargs['hidden_size']} is not divisible by {heads}")
    if not spec.is_decoder:
        kwargs.pop("num_key_value_heads", None)
    if spec.model_type in ("gemma2", "gemma3_text") and "layer_types" not in overrides:
        # Gemma 3 itself uses 5 sliding : 1 full; with 2-4 layers alternate so
        # that both kinds are present.
        kwargs["layer_types"] = [
            "sliding_attention" if i % 2 == 0 else "full_attention"
            for i in range(kwargs["num_hidden_layers"])
        ]
    return kwargs


def tiny_config(kind: str, **overrides: Any):  # -> transformers.PretrainedConfig
    """The HF config :func:`build_tiny_model` would save, without building weights."""
    from transformers import AutoConfig

    spec = _kind(kind)
    architecture = overrides.pop("architecture", None) or spec.architecture
    config = AutoConfig.for_model(spec.model_type, **_config_kwargs(spec, overrides))
    config.architectures = [architecture]
    return config


def _kind(kind: str) -> TinyModelKind:
    try:
        return KINDS[kind]
    except KeyError:
        raise ValueError(f"unknown tiny model kind {kind!r}; choose from {sorted(KINDS)}") from None


_TIED_EMBEDDING_SCALE = 0.03
#: The final norm's weight, by the names the tiny kinds give it.
_FINAL_NORMS = ("model.norm.weight", "transformer.ln_f.weight")


def _input_embedding_scale(config: Any, spec: TinyModelKind) -> float:
    """The factor the model multiplies token embeddings by before the first layer."""
    if spec.model_type in ("gemma2", "gemma3_text"):
        return math.sqrt(config.hidden_size)
    if spec.model_type in ("granite", "granitemoe"):
        return float(config.embedding_multiplier)
    return 1.0


def _is_norm(name: str) -> bool:
    return "norm" in name.lower()  # RMSNorm, LayerNorm, q/k norms, Gemma's sandwich norms


def _is_tied_decoder(config: Any, spec: TinyModelKind) -> bool:
    return spec.is_decoder and bool(getattr(config, "tie_word_embeddings", False))


def init_weights_(model: torch.nn.Module, config: Any, spec: TinyModelKind, seed: int) -> None:
    """Overwrite every parameter with a seeded draw; see the module docstring."""
    hidden = config.hidden_size
    input_scale = _input_embedding_scale(config, spec)
    if _is_tied_decoder(config, spec):
        # The embedding is also the LM head, so after the final norm the
        # hidden state still points along the current token's own embedding
        # and, with unit-scale embeddings, the model predicts the token it just
        # read, forever. Embeddings of 1/8 of the layers' output scale keep
        # that self-score near one standard deviation of the other logits;
        # the final norm's gain then brings the logit std back to about 2.
        emb_std = _TIED_EMBEDDING_SCALE / input_scale
        final_norm_gain = 2.0 / (math.sqrt(hidden) * emb_std)
    else:
        emb_std = 1.0 / input_scale
        final_norm_gain = 1.0
    with torch.no_grad():
        # named_parameters() yields a tied LM head once, under the embedding name.
        for name, param in model.named_parameters():
            gen = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
            noise = torch.randn(param.shape, generator=gen, dtype=torch.float32)
            if param.ndim == 1 and _is_norm(name) and name.endswith("weight"):
                # Keep the class's convention: weight 1 means identity, except
                # Gemma-style norms (initialised to 0) that compute x * (1 + w).
                offset = 0.0 if bool(torch.all(param == 0)) else 1.0
                gain = final_norm_gain if name in _FINAL_NORMS else 1.0
                value = gain * (1.0 + 0.1 * noise) - (1.0 - offset)
            elif name.endswith(".sinks"):
                # Attention-sink logits (gpt-oss): large enough to take a real
                # share of each row's softmax over a few hundred keys.
                value = 3.0 + noise
            elif param.ndim == 1:
                value = 0.1 * noise  # bias
            elif "embed" in name:
                value = emb_std * noise  # token, position and token-type embeddings
            elif name.startswith("lm_head."):
                # Logit std about 2 after Granite's division by logits_scaling.
                scale = float(getattr(config, "logits_scaling", 1.0))
                value = (2.0 * scale / math.sqrt(param.shape[-1])) * noise
            else:
                # Linear (or fused 3-D expert) weight: fan-in is the last dim.
                value = noise / math.sqrt(param.shape[-1])
            param.copy_(value)


def _model_class(architecture: str):
    import transformers

    try:
        return getattr(transformers, architecture)
    except AttributeError:
        raise ValueError(f"transformers has no class {architecture!r}") from None


def build_tiny_model(
    kind: str,
    out_dir: str | os.PathLike[str],
    *,
    seed: int = DEFAULT_SEED,
    dtype: torch.dtype = DEFAULT_DTYPE,
    **overrides: Any,
) -> Path:
    """Build a tiny random model of ``kind`` and save it, with the tokenizer, in ``out_dir``.

    ``kind`` is one of :data:`KINDS` (llama, mistral, granite, granitemoe, falcon, qwen2,
    qwen3, phi3, stablelm, glm4, gemma2, gemma3, mixtral, qwen3_moe, bert, roberta,
    xlm-roberta). ``overrides`` are HF config fields (``num_hidden_layers=3``,
    ``head_dim=32``, ``intermediate_size=200``, ``num_key_value_heads=1``,
    ``sliding_window=...``), plus ``rope_theta=`` as a shorthand and
    ``architecture=`` to save another class of the same model type (e.g.
    ``"BertForSequenceClassification"`` with ``num_labels=1``).
    The result is a pure function of the arguments and the installed
    transformers/tokenizers versions: building twice gives identical files.
    """
    from transformers.utils import logging as hf_logging

    spec = _kind(kind)
    overrides = dict(overrides)
    architecture = overrides.pop("architecture", None) or spec.architecture
    config = tiny_config(kind, architecture=architecture, **overrides)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)

    cls = _model_class(architecture)
    torch_state = torch.random.get_rng_state()
    try:
        # from_config runs transformers' own (random) init; seed it so that any
        # tensor our init does not cover is still deterministic.
        torch.manual_seed(seed)
        model = cls._from_config(config, dtype=torch.float32)
    finally:
        torch.random.set_rng_state(torch_state)
    init_weights_(model, config, spec, seed)
    model = model.to(dtype).eval()

    progress = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        model.save_pretrained(out)
    finally:
        if progress:
            hf_logging.enable_progress_bar()
    save_tokenizer(out, spec.tokenizer_style, model_max_length=_usable_positions(config, spec))
    return out


def save_config_only(config: Any, out_dir: str | os.PathLike[str]) -> Path:
    """A model folder with ``config.json`` and the test tokenizer but no weights.

    Enough for ``EngineArgs(...).create_engine_config()``, which reads the
    config and never the weights: start-up checks can be tested on
    architectures and settings the tiny builders do not cover, in milliseconds.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    config.save_pretrained(out)
    save_tokenizer(out, "decoder")
    return out


def _usable_positions(config: Any, spec: TinyModelKind) -> int:
    if spec.model_type in ("roberta", "xlm-roberta"):
        return config.max_position_embeddings - config.pad_token_id - 1
    return config.max_position_embeddings
