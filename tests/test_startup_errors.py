"""Configurations the plugin cannot serve fail at start-up, naming the setting and the fix.

Built through ``EngineArgs.create_engine_config`` — the same path ``LLM(...)``
and ``vllm serve`` take before any engine process starts — so the error
reaches the user's own process.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch
from transformers import AutoConfig
from vllm.engine.arg_utils import EngineArgs

from spyre_inference.platform import device, settings
from spyre_inference.platform.platform import TorchSpyrePlatform
from spyre_inference.testing.models import save_config_only, tiny_config


@pytest.fixture(autouse=True)
def _fresh_settings(monkeypatch):
    device.reset_for_tests()
    yield
    device.reset_for_tests()


def _config(model, **kwargs):
    kwargs.setdefault("max_model_len", 256)
    return EngineArgs(model=str(model), **kwargs).create_engine_config()


def _small(model_type: str, architecture: str, **fields):
    """An HF config of another architecture, small (no weights are ever built)."""
    return AutoConfig.for_model(model_type, vocab_size=1024, architectures=[architecture], **fields)


@pytest.fixture(scope="module")
def config_only(tmp_path_factory):
    """Model folders without weights, for the checks that read only the config."""
    base = tmp_path_factory.mktemp("config-only")
    configs = {
        # Cohere: full-head RoPE, but built GPT-J-style (is_neox_style=False) by vLLM.
        "interleaved_rope": _small(
            "cohere",
            "CohereForCausalLM",
            hidden_size=256,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            intermediate_size=512,
        ),
        "partial_rope": tiny_config(
            "llama",
            rope_parameters={
                "rope_type": "default",
                "rope_theta": 10000.0,
                "partial_rotary_factor": 0.5,
            },
        ),
        # Phi-2's shape: head 80 (stick-padded to 128), a rotary share of 0.4.
        "partial_rope_padded_head": tiny_config(
            "llama",
            head_dim=80,
            rope_parameters={
                "rope_type": "default",
                "rope_theta": 10000.0,
                "partial_rotary_factor": 0.4,
            },
        ),
        # StableLM-2-12B's head: 160 (padded to 192, where 40 / 192 is not exact).
        "partial_rope_head_160": tiny_config(
            "llama",
            head_dim=160,
            rope_parameters={
                "rope_type": "default",
                "rope_theta": 10000.0,
                "partial_rotary_factor": 0.25,
            },
        ),
        # GPT-NeoX (Pythia): partial rotary; vLLM 0.33 builds it with its Transformers backend.
        "partial_rope_transformers_backend": _small(
            "gpt_neox",
            "GPTNeoXForCausalLM",
            hidden_size=256,
            num_hidden_layers=2,
            num_attention_heads=4,
            intermediate_size=512,
            rotary_pct=0.25,
        ),
        # Llama 4 text: MoE that weights each expert's input by its router weight.
        "router_weight_on_input": _small(
            "llama4_text",
            "Llama4ForCausalLM",
            hidden_size=256,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=64,
            intermediate_size=512,
            intermediate_size_mlp=512,
            num_local_experts=2,
            num_experts_per_tok=1,
        ),
        # BLOOM: ALiBi, head_dim = hidden_size / n_head.
        "alibi": _small("bloom", "BloomForCausalLM", hidden_size=256, n_layer=2, n_head=4),
        "odd_head": _small("bloom", "BloomForCausalLM", hidden_size=252, n_layer=2, n_head=4),
        "gemma2": tiny_config("gemma2"),
        "granite_hybrid": tiny_config("granitemoehybrid"),
        # Mamba (v1) mixers: attention-free, not the Mamba2 mixer the models package serves.
        "mamba1": _small(
            "mamba", "MambaForCausalLM", hidden_size=256, num_hidden_layers=2, state_size=16
        ),
        # DeepSeek-V2: multi-head latent attention (kv_lora_rank), MoE.
        "mla": _small(
            "deepseek_v2",
            "DeepseekV2ForCausalLM",
            hidden_size=256,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=4,
            intermediate_size=512,
            moe_intermediate_size=128,
            n_routed_experts=4,
            num_experts_per_tok=2,
            kv_lora_rank=64,
            q_lora_rank=None,
            qk_rope_head_dim=32,
            qk_nope_head_dim=64,
            v_head_dim=64,
        ),
    }
    return {name: save_config_only(cfg, base / name) for name, cfg in configs.items()}


def test_multimodal_model_is_rejected(tmp_path) -> None:
    """A multimodal checkpoint vLLM accepts at configuration (PaliGemma, config only)
    is refused in the user's process, by architecture."""
    model = save_config_only(
        AutoConfig.for_model("paligemma", architectures=["PaliGemmaForConditionalGeneration"]),
        tmp_path / "paligemma",
    )
    expected = r"PaliGemmaForConditionalGeneration is a multimodal model: .*text-only checkpoint"
    with pytest.raises(ValueError, match=expected):
        _config(model)


def _quantized(tmp_path, name: str, kind: str = "llama", **quant: object):
    config = tiny_config(kind)
    config.quantization_config = quant
    return save_config_only(config, tmp_path / name)


@pytest.mark.parametrize(
    ("name", "quant", "expected"),
    [
        (
            "awq",
            {"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": True,
             "version": "gemm"},
            # vLLM resolves an AWQ checkpoint on this platform to its auto_awq method.
            r"quantization='auto_awq' .*not supported by spyre-inference: it serves "
            r"compressed-tensors, fp8",
        ),
        (
            "gptq",
            {"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": False,
             "sym": True},
            r"quantization='auto_gptq' .*not supported",
        ),
        (
            "fp8-block",
            {"quant_method": "fp8", "activation_scheme": "dynamic",
             "weight_block_size": [128, 128]},
            r"quantization='fp8' .*block-scaled weights \(weight_block_size=\[128, 128\]\)",
        ),
        (
            "w4a16",
            {"quant_method": "compressed-tensors", "format": "pack-quantized",
             "config_groups": {"group_0": {"targets": ["Linear"], "weights": {
                 "num_bits": 4, "type": "int", "symmetric": True, "strategy": "group",
                 "group_size": 128}}}},
            r"group 'group_0' uses 4-bit int weights.*Serve an unquantized",
        ),
    ],
)  # fmt: skip
def test_quantization_the_kernels_do_not_serve_is_refused_by_name(tmp_path, name, quant, expected):
    """Methods and schemes the ops package has no kernel for fail in the user's
    process, naming the method (or group) and what is served; before, each died in
    the engine with vLLM's "Failed to find a kernel"."""
    with pytest.raises(ValueError, match=expected):
        _config(_quantized(tmp_path, name, **quant))


def test_quantized_moe_is_refused(tmp_path) -> None:
    from spyre_inference.testing.quantize import quantization_config

    model = _quantized(tmp_path, "moe-fp8", "mixtral", **quantization_config("fp8_w8a8"))
    expected = r"mixture-of-experts model: .*expert kernels are unquantized"
    with pytest.raises(ValueError, match=expected):
        _config(model)


def test_served_quantization_passes_the_start_up_checks(tmp_path, tiny_llama) -> None:
    from spyre_inference.testing.quantize import SCHEMES, quantization_config

    for scheme in SCHEMES:
        config = _config(_quantized(tmp_path, scheme, **quantization_config(scheme)))
        assert config.model_config.quantization == "compressed-tensors"
    assert _config(tiny_llama, quantization="fp8").model_config.quantization == "fp8"


def test_gpt_oss_mxfp4_checkpoint_is_refused_by_name(tmp_path) -> None:
    """gpt-oss's released checkpoints are MXFP4 (a quantization method): refused in the
    user's process, naming it; the bfloat16 form runs (models package, test_gpt_oss)."""
    config = tiny_config("gpt_oss")
    config.quantization_config = {"quant_method": "mxfp4"}
    model = save_config_only(config, tmp_path / "gpt-oss-mxfp4")
    with pytest.raises(ValueError, match=r"quantization='gpt_oss_mxfp4' .*not supported"):
        _config(model)


def test_multi_head_latent_attention_is_rejected(config_only) -> None:
    """MLA models (DeepSeek-V2/V3, Kimi) passed the start-up checks and had no backend."""
    expected = r"DeepseekV2ForCausalLM uses multi-head latent attention .*serve a model with"
    with pytest.raises(ValueError, match=expected):
        _config(config_only["mla"])


def test_data_parallel_is_rejected(tiny_llama) -> None:
    with pytest.raises(ValueError, match=r"data_parallel_size=2 .*Remove --data-parallel-size"):
        _config(tiny_llama, data_parallel_size=2)


@pytest.mark.parametrize(
    ("kv_dtype", "expected"),
    [
        # The plugin's rule: the Spyre KV cache is kept in the model dtype.
        ("fp8", r"--kv-cache-dtype fp8 is not supported.*Remove --kv-cache-dtype or set it to"),
        # A real dtype that is not the model's (tiny_llama is bfloat16): vLLM's own
        # check, which already names the flag and the fix, answers first.
        ("float16", r"kv_cache_dtype=\"float16\" is incompatible.*`--kv-cache-dtype` to `auto`"),
    ],
)
def test_kv_cache_dtype_other_than_model_dtype_is_rejected(tiny_llama, kv_dtype, expected) -> None:
    with pytest.raises(ValueError, match=expected):
        _config(tiny_llama, kv_cache_dtype=kv_dtype)


def test_dtype_outside_the_target_is_rejected(tiny_llama) -> None:
    # The CLI's string never reaches the platform: vLLM's own validation
    # refuses it and lists the names it accepts.
    with pytest.raises(ValueError, match=r"(?s)dtype.*Input should be 'auto', 'half', 'float16'"):
        _config(tiny_llama, dtype="float64")
    # A torch dtype (Python API) reaches the cpu target's rule.
    expected = r"--dtype float64 is not supported on the cpu target.*one of bfloat16, float16"
    with pytest.raises(ValueError, match=expected):
        _config(tiny_llama, dtype=torch.float64)
    # The spyre target's rule (float16 only), checked by the same code the
    # platform runs at start-up on a card.
    with pytest.raises(ValueError, match=r"--dtype bfloat16 is not supported on the spyre target"):
        TorchSpyrePlatform._check_dtype(torch.bfloat16, device.DeviceTarget.SPYRE)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
def test_cpu_target_accepts_its_dtypes(tiny_llama, dtype) -> None:
    assert _config(tiny_llama, dtype=dtype).model_config.dtype == getattr(torch, dtype)


def test_block_size_default_and_rounding(tiny_llama) -> None:
    assert _config(tiny_llama).cache_config.block_size == 128
    assert _config(tiny_llama, block_size=100).cache_config.block_size == 128
    assert _config(tiny_llama, block_size=64).cache_config.block_size == 64


#: An unknown value for every plugin setting; a setting added to
#: spyre_inference.platform.settings without one here fails the test below.
INVALID_SETTING_VALUES = {
    "SPYRE_DEVICE_TARGET": "gpu",
    "SPYRE_EMULATED_DEVICE_MEMORY_GB": "-2",
    "SPYRE_COMPILE_GRANULARITY": "layer",
    "SPYRE_NUM_TOKENS_BUCKETS": "16,big",
    "SPYRE_SETTLED_GUARDS": "sometimes",
    "SPYRE_DIRECT_BLOCK_CALLS": "yes-please",
    "SPYRE_BUCKET_ALIGNED_PREFILL": "half",
    "SPYRE_CPU_TCMALLOC": "jemalloc",
    "SPYRE_SAMPLER": "flashinfer",
    "SPYRE_ATTN_KV_LAYOUT": "diagonal",
    "SPYRE_ATTN_RECORD": "sometimes",
    "SPYRE_BATCHED_DECODE": "2",
    "SPYRE_ATTN_NUM_SEQS_BUCKETS": "0,8",
    "SPYRE_ATTN_MAX_CORES": "-4",
    "SPYRE_CPU_GEMM_DTYPE": "bfloat16",
    "SPYRE_CPU_GEMM_KERNEL": "avx512",
    "SPYRE_CPU_GEMM_PACK": "on",
    "SPYRE_CPU_GEMM_HOST_ROWS": "-1",
    "SPYRE_CPU_INT8_VOCAB": "maybe",
    "SPYRE_CPU_ISA": "sse4",
    "SPYRE_CPU_ATTN_KERNEL": "avx2",
    "SPYRE_CPU_PREFILL_KERNEL": "flash",
    "SPYRE_DEFAULT_MODEL_DIR": "{a_file}",
}


@pytest.mark.parametrize("name", [s.name for s in settings.all_settings()])
def test_unknown_setting_value_names_the_variable_and_the_fix(
    tiny_llama, monkeypatch, tmp_path, name
) -> None:
    assert name in INVALID_SETTING_VALUES, f"add an invalid example of {name} to this test"
    a_file = tmp_path / "a_file"
    a_file.write_text("")
    value = INVALID_SETTING_VALUES[name].format(a_file=a_file)
    monkeypatch.setenv(name, value)
    settings.reset_cache()
    device.reset_for_tests()
    with pytest.raises(ValueError) as err:
        _config(tiny_llama)
    message = str(err.value)
    assert f"{name}={value!r}" in message
    assert "use one of" in message or "Unset it to use the default" in message, message


def test_gemma2_in_float16_keeps_vllms_refusal_on_the_cpu_target(config_only) -> None:
    """Only the card path, whose one dtype is float16, lifts vLLM's refusal (the
    emulated tests serve Gemma 2 there); the cpu target has bfloat16."""
    with pytest.raises(ValueError, match=r"does not support float16"):
        _config(config_only["gemma2"], dtype="float16")
    assert _config(config_only["gemma2"], dtype="bfloat16").model_config is not None


def test_interleaved_and_partial_rope_are_accepted(config_only) -> None:
    """The ops package's pair form serves them (its tests compare with vLLM's RoPE)."""
    assert _config(config_only["interleaved_rope"]).model_config is not None
    assert _config(config_only["partial_rope"]).model_config is not None
    # Through vLLM's Transformers backend too (the models package's pair form).
    assert _config(config_only["partial_rope_transformers_backend"]).model_config is not None


def test_moe_weighting_expert_inputs_is_rejected(config_only) -> None:
    """It failed loading the weights, inside the engine process, before."""
    expected = r"Llama4ForCausalLM multiplies each expert's input by its router weight"
    with pytest.raises(ValueError, match=expected):
        _config(config_only["router_weight_on_input"])


@pytest.mark.parametrize(
    ("option", "expected"),
    [
        ({"enable_expert_parallel": True, "tensor_parallel_size": 2}, "--enable-expert-parallel"),
        ({"enable_return_routed_experts": True}, "--enable-return-routed-experts"),
    ],
    ids=["expert-parallel", "routed-experts"],
)
def test_moe_options_the_spyre_method_does_not_compute_are_refused(
    tiny_model_factory, option, expected
) -> None:
    """Each died inside the engine: expert parallelism building the first MoE layer,
    the routed-experts capture on the first step (the Spyre forms record no top-k)."""
    with pytest.raises(ValueError, match=rf"{expected} is not supported .*Remove {expected}"):
        _config(tiny_model_factory("mixtral"), **option)


@pytest.mark.parametrize(
    ("name", "padded", "width"),
    [("partial_rope_padded_head", 128, 32), ("partial_rope_head_160", 192, 40)],
    ids=["phi2_head_80", "stablelm2_12b_head_160"],
)
def test_partial_rope_on_a_padded_head_keeps_its_rotary_width(
    config_only, name, padded, width
) -> None:
    """The head is widened to whole sticks and the rotary share pinned to the
    checkpoint's width (vLLM would derive int(128 * 0.4) = 51 from Phi-2's widened
    head): ``rope_dim`` for vLLM's get_rope, a rescaled factor for readers that
    multiply (Hugging Face's modules on the Transformers backend)."""
    from spyre_inference.platform.stick_pad import PLAN_KEY

    config = _config(config_only[name])
    params = config.model_config.hf_text_config.rope_parameters
    assert config.model_config.get_head_size() == padded
    assert params["rope_dim"] == width
    factor = params["partial_rotary_factor"]
    assert int(padded * factor) == width and round(padded * factor) == width
    assert config.additional_config[PLAN_KEY]["rotary_dims"] == [width]


def test_head_size_that_cannot_be_padded_is_rejected(config_only) -> None:
    with pytest.raises(ValueError, match=r"head_dim=63 .*serve a model whose head_dim is even"):
        _config(config_only["odd_head"])


def test_head_major_layout_with_alibi_is_rejected(config_only, monkeypatch) -> None:
    _config(config_only["alibi"])  # the token-major layout serves ALiBi
    monkeypatch.setenv("SPYRE_ATTN_KV_LAYOUT", "head_major")
    settings.reset_cache()
    expected = r"SPYRE_ATTN_KV_LAYOUT=head_major cannot serve BloomForCausalLM.*ALiBi.*token_major"
    with pytest.raises(ValueError, match=expected):
        _config(config_only["alibi"])


def test_head_major_layout_with_batched_decode_is_rejected(tiny_llama, monkeypatch) -> None:
    monkeypatch.setenv("SPYRE_ATTN_KV_LAYOUT", "head_major")
    settings.reset_cache()
    _config(tiny_llama)  # the default (on) is not a request: head-major decodes per sequence
    monkeypatch.setenv("SPYRE_BATCHED_DECODE", "1")
    settings.reset_cache()
    expected = (
        r"SPYRE_BATCHED_DECODE=1 is not available with SPYRE_ATTN_KV_LAYOUT=head_major.*Unset"
    )
    with pytest.raises(ValueError, match=expected):
        _config(tiny_llama)


def test_spyre_target_without_a_card_is_a_clear_error(tiny_llama, monkeypatch) -> None:
    monkeypatch.setenv("SPYRE_DEVICE_TARGET", "spyre")
    device.reset_for_tests()
    expected = r"SPYRE_DEVICE_TARGET=spyre but .*SPYRE_DEVICE_TARGET=cpu"
    with pytest.raises(RuntimeError, match=expected):
        device.target_choice()


@pytest.mark.parametrize("isa", ["avx2", "avx512", "avx512bf16"])
def test_forced_cpu_isa_is_used_or_refused_at_start_up(tiny_llama, monkeypatch, isa) -> None:
    """SPYRE_CPU_ISA naming an instruction set this CPU runs is accepted; one it
    lacks is refused in the user's process, naming the setting and the fix."""
    from spyre_inference.platform import native_build

    needed = {i.name: i.cpu_flags for i in native_build.ISAS}[isa]
    monkeypatch.setenv("SPYRE_CPU_ISA", isa)
    settings.reset_cache()
    device.reset_for_tests()
    if set(needed) <= native_build.cpu_flags():
        assert _config(tiny_llama).model_config is not None
        return
    with pytest.raises(
        ValueError, match=rf"SPYRE_CPU_ISA={isa}: the CPU lacks .*Unset SPYRE_CPU_ISA"
    ):
        _config(tiny_llama)


@pytest.mark.parametrize(
    ("option", "expected"),
    [
        (
            {"enable_sleep_mode": True},
            r"sleep mode \(--enable-sleep-mode.*not supported.*Remove --enable-sleep-mode",
        ),
        (
            {"kv_offloading_size": 1},
            r"KV cache offloading \(--kv-offloading-size 1\).*Remove --kv-offloading-size",
        ),
        (
            {"kv_transfer_config": {"kv_connector": "ExampleConnector", "kv_role": "kv_both"}},
            r"KV connector ExampleConnector \(--kv-transfer-config\).*Remove",
        ),
        (
            {"attention_backend": "FLASH_ATTN"},
            r"--attention-backend FLASH_ATTN: the Spyre platform runs its own.*Remove",
        ),
        (
            {"attention_backend": "CPU_ATTN"},
            r"--attention-backend CPU_ATTN: .*Remove --attention-backend",
        ),
    ],
    ids=["sleep", "kv-offloading", "kv-connector", "flash-attn", "cpu-attn"],
)
def test_unsupported_engine_option_is_refused_at_start_up(tiny_llama, option, expected) -> None:
    """Each fails in the user's process, naming the option and what to do (before
    this, each died inside the engine process with an unrelated error)."""
    with pytest.raises(ValueError, match=expected):
        _config(tiny_llama, **option)


def test_prefetch_weight_offloading_is_refused_and_uva_is_a_no_op(tiny_llama) -> None:
    """vLLM's prefetch offloader needs CUDA streams (it died building the model);
    ``--cpu-offload-gb`` passes on the cpu target, where the weights are host memory."""
    with pytest.raises(ValueError, match=r"prefetch weight offloading .*CUDA streams"):
        _config(tiny_llama, offload_group_size=2, offload_num_in_group=1)
    assert _config(tiny_llama, cpu_offload_gb=1).offload_config.uva.cpu_offload_gb == 1


def test_xxhash_prefix_hashing_without_the_package_is_refused(tiny_llama) -> None:
    """vLLM imports xxhash in the engine process, which died at start without it."""
    if importlib.util.find_spec("xxhash") is not None:
        assert _config(tiny_llama, prefix_caching_hash_algo="xxhash")
        return
    with pytest.raises(ValueError, match=r"--prefix-caching-hash-algo xxhash .*pip install"):
        _config(tiny_llama, prefix_caching_hash_algo="xxhash")


def test_a_memory_share_below_one_sequence_is_refused_with_the_numbers(tmp_path) -> None:
    """``--gpu-memory-utilization`` too small for one sequence's KV cache fails in the
    user's process (it failed in the engine's memory plan, after the weights loaded)."""
    import psutil

    layers, kv_heads, head, tokens = 8, 8, 128, 8192
    model = save_config_only(
        AutoConfig.for_model(
            "llama", vocab_size=1024, hidden_size=kv_heads * head, num_hidden_layers=layers,
            num_attention_heads=kv_heads, num_key_value_heads=kv_heads, intermediate_size=512,
            architectures=["LlamaForCausalLM"], max_position_embeddings=tokens,
        ),
        tmp_path / "long-context",
    )  # fmt: skip
    one_sequence = 2 * kv_heads * head * layers * tokens * 2  # K and V, bfloat16: 0.25 GiB
    share = one_sequence / psutil.virtual_memory().total
    expected = (
        rf"--gpu-memory-utilization {share / 4:g} gives each worker .* less than .* "
        r"max_model_len=8192 .*0.25 GiB.* Raise --gpu-memory-utilization above"
    )
    with pytest.raises(ValueError, match=expected):
        _config(model, dtype="bfloat16", max_model_len=tokens, gpu_memory_utilization=share / 4)
    assert _config(model, dtype="bfloat16", max_model_len=tokens, gpu_memory_utilization=0.9)


def test_the_spyre_attention_backend_may_be_named(tiny_llama) -> None:
    """``--attention-backend CUSTOM`` names the slot the Spyre backends report."""
    config = _config(tiny_llama, attention_backend="CUSTOM")
    assert config.attention_config.backend.name == "CUSTOM"


def test_draft_model_speculation_is_refused_at_start_up(tiny_llama) -> None:
    """Speculative methods other than ngram need a second model runner: refused by name."""
    spec = {"model": str(tiny_llama), "num_speculative_tokens": 2}
    expected = (
        r"speculative decoding \(--speculative-config, method='draft_model'\) is not "
        r"supported .*use method='ngram'"
    )
    with pytest.raises(ValueError, match=expected):
        _config(tiny_llama, speculative_config=spec)


def test_lora_passes_the_start_up_checks_on_the_cpu_target(tiny_llama, monkeypatch) -> None:
    """LoRA is served on the cpu target (tests/test_lora.py) with the default buckets;
    the card path refuses it."""
    from spyre_inference.platform import settings

    monkeypatch.delenv("SPYRE_NUM_TOKENS_BUCKETS", raising=False)
    settings.reset_cache()
    config = _config(tiny_llama, enable_lora=True, max_lora_rank=8)
    assert config.lora_config is not None


def test_a_one_token_bucket_with_lora_is_refused_at_start_up(tiny_llama, monkeypatch) -> None:
    """vLLM's LoRA ops cannot be compiled for a 1-token step (Dynamo stops on a
    data-dependent guard mid-serving): a configured bucket of 1 with LoRA is refused by
    name; the default buckets with LoRA start at 2 on the cpu target."""
    from spyre_inference.platform import settings
    from spyre_inference.platform.token_buckets import TokenBuckets

    monkeypatch.setenv("SPYRE_NUM_TOKENS_BUCKETS", "1,4,16")
    settings.reset_cache()
    try:
        with pytest.raises(ValueError, match=r"SPYRE_NUM_TOKENS_BUCKETS holds 1 with LoRA"):
            _config(tiny_llama, enable_lora=True, max_lora_rank=8)
        assert _config(tiny_llama).lora_config is None  # without LoRA, 1 is served
        monkeypatch.delenv("SPYRE_NUM_TOKENS_BUCKETS")
        settings.reset_cache()
        assert TokenBuckets(64, lora=True).sizes == (2, 4, 8, 16, 32, 64)
        assert TokenBuckets(64).sizes == (1, 2, 4, 8, 16, 32, 64)
    finally:
        settings.reset_cache()


def test_ngram_speculation_passes_the_start_up_checks(tiny_llama) -> None:
    """ngram is served on the cpu target (tests/test_speculative_decoding.py)."""
    config = _config(
        tiny_llama,
        speculative_config={"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3},
    )
    assert config.speculative_config.method == "ngram"


def test_a_batch_whose_logits_cannot_fit_the_host_is_refused_at_start_up(tmp_path) -> None:
    """A 262,144-token vocabulary in float32 with more sampled rows than the host can
    hold logits for: refused with the numbers in the user's process (issue 21: such a
    configuration was OOM-killed in warm-up)."""
    import psutil

    from spyre_inference.testing.models import save_config_only

    vocab = 262_144
    model = save_config_only(
        AutoConfig.for_model(
            "llama", vocab_size=vocab, hidden_size=256, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, intermediate_size=512,
            architectures=["LlamaForCausalLM"], max_position_embeddings=512,
        ),
        tmp_path / "big-vocab",
    )  # fmt: skip
    # float32 logits: 4 bytes per row per token; enough rows for twice the host.
    rows = -(-2 * psutil.virtual_memory().total // (vocab * 4))
    with pytest.raises(ValueError, match=r"needs at least .* GiB of host memory \(.*logits"):
        _config(model, dtype="float32", max_num_seqs=rows, max_num_batched_tokens=rows)
    # The same model with a batch the host can hold passes the check.
    assert _config(model, dtype="float32", max_num_seqs=16, max_num_batched_tokens=128)


def test_mamba_hybrid_with_prefix_caching_is_refused_by_name(config_only) -> None:
    """Granite 4 hybrid runs (models package, test_granite_hybrid) with one state per
    request: vLLM's per-block Mamba states for prefix caching are refused by name."""
    expected = r"prefix caching with Mamba layers .*--no-enable-prefix-caching"
    with pytest.raises(ValueError, match=expected):
        _config(config_only["granite_hybrid"], enable_prefix_caching=True)
    config = _config(config_only["granite_hybrid"], enable_prefix_caching=False)
    # Mamba states need vLLM's hybrid KV-cache manager: kept on for this model.
    assert config.scheduler_config.disable_hybrid_kv_cache_manager is False


def test_mamba_with_tensor_parallelism_is_refused_by_name(config_only) -> None:
    expected = r"tensor/pipeline parallelism with Mamba layers .*serve .* on one rank"
    with pytest.raises(ValueError, match=expected):
        _config(config_only["granite_hybrid"], enable_prefix_caching=False, tensor_parallel_size=2)


def test_mamba_architecture_not_verified_is_refused_by_name(config_only) -> None:
    expected = (
        r"MambaForCausalLM has Mamba \(state-space\) layers.*GraniteMoeHybridForCausalLM only"
    )
    with pytest.raises(ValueError, match=expected):
        _config(config_only["mamba1"], enable_prefix_caching=False)


def test_other_models_keep_one_kv_cache_group(tiny_llama) -> None:
    """The platform reports hybrid KV-cache support for Mamba's sake; every other model
    stays on one group, and asking for the hybrid manager there is refused."""
    assert _config(tiny_llama).scheduler_config.disable_hybrid_kv_cache_manager is True
    with pytest.raises(ValueError, match=r"--enable-hybrid-kv-cache-manager .*Mamba layers only"):
        _config(tiny_llama, disable_hybrid_kv_cache_manager=False)
