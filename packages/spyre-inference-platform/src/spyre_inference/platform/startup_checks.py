"""Start-up checks: refuse a configuration the plugin cannot serve, before anything loads.

The platform runs these from ``check_and_update_config``, in the process the
user started (``vllm serve`` or ``LLM(...)``), before an engine process is
spawned or a weight is read: an error raised later, in the engine process,
reaches the user only as "Engine core initialization failed" with the cause
buried in the log. Every message names the setting that is wrong and says what
to do instead.

The core knows its own rules (parallelism, dtype, KV-cache dtype, settings) and
which sub-package a configuration needs. Rules that belong to a sub-package
(RoPE forms the ops package can rotate, what the head-major attention layout
supports) are published by that package in the entry-point group
:data:`~spyre_inference.platform.discovery.CONFIG_CHECKS_GROUP` and run here
too, so the core never imports a sub-package by name.
"""

from __future__ import annotations

import importlib.util
import math
from typing import TYPE_CHECKING

from spyre_inference.platform import (
    device,
    discovery,
    mamba_checks,
    native_build,
    settings,
    stick_pad,
    token_buckets,
)
from spyre_inference.platform.device import STICK_ELEMS
from spyre_inference.platform.logs import get_logger

if TYPE_CHECKING:
    from vllm.config import VllmConfig

logger = get_logger(__name__)


class ConfigError(ValueError):
    """A configuration the plugin cannot serve; raised at start-up."""


def check_head_size(vllm_config: VllmConfig) -> None:
    """A head dimension the plugin cannot pad to whole sticks is refused."""
    head_dim = stick_pad.head_dim_to_pad(vllm_config)
    if head_dim is not None and head_dim % 2:
        raise ConfigError(
            f"head_dim={head_dim} (the model's config.json) cannot be padded to the "
            f"{STICK_ELEMS}-element Spyre stick: the padding is inserted after each "
            "half of the neox rotary layout, which needs two equal halves. spyre-inference "
            "cannot serve this model; serve a model whose head_dim is even."
        )


def check_cpu_isa() -> None:
    """A forced ``SPYRE_CPU_ISA`` this CPU cannot run is refused (cpu target).

    Left to the kernels, it would only make them unavailable and the layers
    fall back to slower paths with an info line in the engine's log.
    """
    forced = settings.get("SPYRE_CPU_ISA")
    if forced == "auto" or device.is_spyre():
        return
    try:
        native_build.select_isa([isa.name for isa in native_build.ISAS])
    except native_build.NativeKernelUnavailable as exc:
        raise ConfigError(
            f"{exc}. Unset SPYRE_CPU_ISA (auto picks the widest this CPU runs) or name one it has."
        ) from exc


#: Set once the host-memory check has passed in the user's process.
_HOST_MEMORY_CHECKED = "_SPYRE_INFERENCE_HOST_MEMORY_CHECKED"


def check_host_memory(vllm_config: VllmConfig) -> None:
    """A configuration whose smallest host footprint exceeds the available memory is
    refused with the numbers (the cpu target; the card's memory is the worker's to check).

    Left alone, it would be OOM-killed in warm-up or on its first full step.
    """
    import os

    import psutil

    from spyre_inference.platform.memory_plan import GiB, size_text, startup_lower_bound

    if device.is_spyre() or vllm_config.model_config is None:
        return
    # vLLM runs the platform's config checks again inside the engine process
    # (seen after warm-up), where this engine's own model and KV cache already
    # fill the host: the check belongs to the user's process, before any of
    # that exists. The marker names the configuration checked; engine
    # processes inherit it.
    mc, sc = vllm_config.model_config, vllm_config.scheduler_config
    cc, pc = vllm_config.cache_config, vllm_config.parallel_config
    key = (
        f"{mc.model}|{mc.dtype}|{mc.max_model_len}|{sc.max_num_seqs}|"
        f"{sc.max_num_batched_tokens}|{pc.tensor_parallel_size}|{pc.pipeline_parallel_size}|"
        f"{cc.gpu_memory_utilization}|{cc.kv_cache_memory_bytes}"
    )
    if os.environ.get(_HOST_MEMORY_CHECKED) == key:
        return
    need = startup_lower_bound(vllm_config)
    memory = psutil.virtual_memory()
    available = memory.available
    if not cc.kv_cache_memory_bytes:
        # Each worker's KV cache is gpu_memory_utilization of the host minus what
        # the worker holds (memory_plan.plan_host_kv, as vLLM's CPU worker): a
        # share below the worker's part of the weights and of one sequence's
        # cache fails in every engine, after the weights have loaded.
        workers = pc.tensor_parallel_size * pc.pipeline_parallel_size
        floor = (need["weights"] + need["kv_one_sequence"] * pc.pipeline_parallel_size) / workers
        share = memory.total * cc.gpu_memory_utilization
        if share < floor:
            enough = math.ceil(100 * floor / memory.total) / 100
            raise ConfigError(
                f"--gpu-memory-utilization {cc.gpu_memory_utilization:g} gives each worker "
                f"{size_text(share)} of the host's {size_text(memory.total)}, less than its "
                f"part of the weights and of one max_model_len={mc.max_model_len} sequence's "
                f"KV cache alone ({size_text(floor)}, before what torch and vLLM hold). Raise "
                f"--gpu-memory-utilization above {enough:g}, lower "
                "--max-model-len, or set --kv-cache-memory-bytes."
            )
    if sum(need.values()) <= available:
        os.environ[_HOST_MEMORY_CHECKED] = key
        return
    parts = ", ".join(f"{k} {v / GiB:.2f}" for k, v in need.items())
    raise ConfigError(
        f"This configuration needs at least {sum(need.values()) / GiB:.2f} GiB of host memory "
        f"({parts}; dtype={vllm_config.model_config.dtype}, "
        f"max_model_len={vllm_config.model_config.max_model_len}, "
        f"max_num_seqs={vllm_config.scheduler_config.max_num_seqs}, "
        f"max_num_batched_tokens={vllm_config.scheduler_config.max_num_batched_tokens}), "
        f"but the host has {available / GiB:.2f} GiB available. Lower --max-num-seqs (the "
        "float32 logits of a step are max_num_seqs x vocabulary), --max-model-len or "
        "--max-num-batched-tokens, or use a 16-bit --dtype."
    )


def check_engine_options(vllm_config: VllmConfig) -> None:
    """Engine options no Spyre target serves yet are refused here, by name.

    Left alone each fails later, inside the engine process, with an error that
    does not name the option: LoRA on the card path (the punica wrapper is
    host code), a
    speculative method other than ngram (or ngram without ``numba``), a
    quantized checkpoint without the ops package's kernels (vLLM's "Failed to
    find a kernel ..."; the ops package checks the schemes it serves), a
    multimodal model (its encoders are not verified), a model with
    multi-head latent attention (no Spyre backend for it),
    sleep mode (vLLM's sleep allocator is CUDA's cumem; on the cpu target
    weights and cache already live in host memory, so there is nothing to
    offload to).
    """
    problems: list[str] = []
    if vllm_config.lora_config is not None and device.is_spyre():
        problems.append(
            "LoRA (--enable-lora / enable_lora=True) has not been verified on a Spyre card "
            "(vLLM's punica kernels for it are host code); it is supported on the cpu "
            "target (SPYRE_DEVICE_TARGET=cpu). Serve the adapter merged into the base "
            "weights, or remove --enable-lora"
        )
    configured = settings.get("SPYRE_NUM_TOKENS_BUCKETS")
    if vllm_config.lora_config is not None and any(
        b < token_buckets.LORA_MIN_BUCKET for b in configured
    ):
        problems.append(
            "SPYRE_NUM_TOKENS_BUCKETS holds 1 with LoRA enabled: vLLM's LoRA ops cannot be "
            "compiled for a 1-token step (a data-dependent shape). Start the buckets at 2 "
            "(e.g. SPYRE_NUM_TOKENS_BUCKETS=2,4,8,...), or unset it for the default"
        )
    spec = vllm_config.speculative_config
    if spec is not None:
        problem = speculative_decoding_problem(
            spec.method, getattr(spec, "rejection_sample_method", "standard")
        )
        if problem:
            problems.append(problem)
    model_config = vllm_config.model_config
    architecture = (
        ", ".join(model_config.architectures or ()) or model_config.model
        if model_config is not None
        else ""
    )
    if model_config is not None and model_config.is_multimodal_model:
        problems.append(
            f"{architecture} is a multimodal model: spyre-inference serves text-only "
            "decoder and encoder models, and its image/audio encoders have not been "
            "verified on either target. Serve a text-only checkpoint of the model"
        )
    if model_config is not None and model_config.use_mla:
        problems.append(
            f"{architecture} uses multi-head latent attention (MLA, the config's "
            "kv_lora_rank), which the Spyre attention backends do not implement (they "
            "serve vLLM's standard Attention layers only): serve a model with "
            "multi-head, grouped-query or multi-query attention"
        )
    if model_config is not None and model_config.enable_sleep_mode:
        problems.append(
            "sleep mode (--enable-sleep-mode / enable_sleep_mode=True) is not supported by "
            "spyre-inference: vLLM's sleep allocator is CUDA memory (cumem), and on the cpu "
            "target the weights and KV cache already live in host memory, with nowhere to "
            "offload them. Remove --enable-sleep-mode; to free the memory, stop the server"
        )
    if (
        model_config is not None
        and model_config.quantization is not None
        and not discovery.general_plugin_enabled("spyre_ops")
    ):
        # The quantized kernels (and the check of which schemes they serve)
        # belong to the ops package's layers; without it nothing computes them.
        problems.append(
            f"quantization={model_config.quantization!r} (--quantization, or the "
            "checkpoint's quantization_config) needs the 8-bit kernels of "
            "spyre-inference-ops, which is not loaded: install it (and keep spyre_ops in "
            "VLLM_PLUGINS), or serve an unquantized bfloat16/float16/float32 checkpoint"
        )
    algo = vllm_config.cache_config.prefix_caching_hash_algo
    if algo.startswith("xxhash") and importlib.util.find_spec("xxhash") is None:
        # vLLM imports it lazily, in the engine process, which then dies at start.
        problems.append(
            f"--prefix-caching-hash-algo {algo} needs the xxhash package, which is not "
            "installed: pip install xxhash, or use sha256 (the default)"
        )
    problems.extend(weight_offload_problems(vllm_config))
    problems.extend(attention_backend_problems(vllm_config))
    problems.extend(kv_transfer_problems(vllm_config))
    problems.extend(mamba_checks.mamba_problems(vllm_config))
    if len(problems) == 1:
        raise ConfigError(problems[0] + ".")
    if problems:
        raise ConfigError(
            "spyre-inference cannot serve these engine options:\n"
            + "\n".join(f"  - {p}" for p in problems)
        )


def weight_offload_problems(vllm_config: VllmConfig) -> list[str]:
    """vLLM's weight offloading: prefetch is refused everywhere, UVA on a card.

    The prefetch offloader overlaps its copies with CUDA streams and events and
    dies building the model ("Tried to instantiate dummy base class Event").
    The UVA offloader (``--cpu-offload-gb``) moves only parameters that are on
    an accelerator when the model is built: the plugin builds on the host, so
    on the cpu target it moves nothing, and the weights are in host memory
    anyway (what offloading would achieve); on a card the weights would then
    all move to the card regardless, silently ignoring the option.
    """
    config = getattr(vllm_config, "offload_config", None)
    if config is None:
        return []
    backend = config.offload_backend
    prefetch = backend == "prefetch" or (
        backend == "auto" and config.prefetch.offload_group_size > 0
    )
    if prefetch:
        return [
            "prefetch weight offloading (--offload-group-size / --offload-backend prefetch) "
            "is not supported by spyre-inference: vLLM's prefetch offloader overlaps its "
            "copies with CUDA streams. Remove it; on the cpu target the weights already "
            "live in host memory"
        ]
    if config.uva.cpu_offload_gb > 0:
        if device.is_spyre():
            return [
                f"--cpu-offload-gb {config.uva.cpu_offload_gb:g} is not supported on a Spyre "
                "card: the compiled graphs read every weight from the card's memory. Remove "
                "--cpu-offload-gb; to fit a larger model, split it over cards with "
                "--tensor-parallel-size"
            ]
        logger.info(
            "--cpu-offload-gb %g: on the cpu target every weight is in host memory already; "
            "nothing is offloaded",
            config.uva.cpu_offload_gb,
        )
    return []


#: The one ``AttentionBackendEnum`` member a user may name: vLLM's slot for
#: out-of-tree backends, which is what every Spyre backend reports.
SPYRE_ATTENTION_BACKEND = "CUSTOM"


def attention_backend_problems(vllm_config: VllmConfig) -> list[str]:
    """``--attention-backend`` naming one of vLLM's GPU/CPU backends is refused.

    The platform picks the Spyre backend itself (``get_attn_backend_cls``); left
    alone, a request for FLASH_ATTN or CPU_ATTN would be silently ignored and the
    user would believe they measured that backend.
    """
    config = getattr(vllm_config, "attention_config", None)
    if config is None:
        return []
    asked = [("--attention-backend", config.backend)]
    asked += [
        (f"backend_per_kind[{kind!r}]", backend)
        for kind, backend in (getattr(config, "backend_per_kind", None) or {}).items()
    ]
    problems = []
    for option, backend in asked:
        name = getattr(backend, "name", backend)
        if name is None or name == SPYRE_ATTENTION_BACKEND:
            continue
        problems.append(
            f"{option} {name}: the Spyre platform runs its own attention backends (the "
            "token-major paged backend by default, SPYRE_ATTN_KV_LAYOUT=head_major for the "
            "head-major one, and the encoder backend for encoder models); vLLM's "
            f"{name} backend does not run on it. Remove --attention-backend, or name "
            f"{SPYRE_ATTENTION_BACKEND}"
        )
    return problems


def kv_transfer_problems(vllm_config: VllmConfig) -> list[str]:
    """KV connectors (offloading, disaggregated prefill) are refused by name.

    Their workers copy KV blocks with CUDA/XPU kernels and die inside the
    engine on any other device ("CPU Offloading is currently only supported on
    CUDA-alike and XPU GPUs"). On the cpu target the KV cache already lives in
    host memory, so offloading it to host memory would gain nothing.
    """
    problems = []
    transfer = vllm_config.kv_transfer_config
    if vllm_config.cache_config.kv_offloading_size is not None:
        problems.append(
            f"KV cache offloading (--kv-offloading-size "
            f"{vllm_config.cache_config.kv_offloading_size:g}) is not supported by "
            "spyre-inference: vLLM's offloading workers copy blocks with GPU kernels, and "
            "on the cpu target the KV cache is already in host memory. Remove "
            "--kv-offloading-size; to hold more tokens, raise --gpu-memory-utilization (a "
            "share of host memory on the cpu target) or --kv-cache-memory-bytes"
        )
    elif transfer is not None and transfer.kv_connector:
        problems.append(
            f"KV connector {transfer.kv_connector} (--kv-transfer-config) is not supported "
            "by spyre-inference: vLLM's KV connectors move cache blocks with GPU kernels "
            "and have not been verified on either Spyre target. Remove --kv-transfer-config"
        )
    ec = getattr(vllm_config, "ec_transfer_config", None)
    if ec is not None and getattr(ec, "ec_connector", None):
        problems.append(
            f"encoder-cache connector {ec.ec_connector} (--ec-transfer-config) is not "
            "supported: spyre-inference serves text-only models. Remove --ec-transfer-config"
        )
    return problems


#: Speculative-decoding methods served on the cpu target: ngram proposes from
#: the request's own tokens on the host (numba), the target model verifies the
#: drafts in one step, and the rejection sampler runs on the host
#: (:mod:`~spyre_inference.platform.rejection_kernels`). Draft-model methods
#: (EAGLE, MTP, a draft model) would need a second model runner on the device.
SPECULATIVE_METHODS = ("ngram",)


#: Rejection-sampling forms whose kernels have host stand-ins
#: (:mod:`~spyre_inference.platform.rejection_kernels`); FLy and block
#: verification launch other Triton kernels.
REJECTION_METHODS = ("standard", "synthetic")


def speculative_decoding_problem(method: str | None, rejection: str = "standard") -> str | None:
    """Why ``--speculative-config`` with ``method`` cannot be served here, or None."""
    option = f"speculative decoding (--speculative-config, method={method!r})"
    if rejection not in REJECTION_METHODS:
        return (
            f"speculative decoding with rejection_sample_method={rejection!r} is not "
            f"supported by spyre-inference (supported: {', '.join(REJECTION_METHODS)}); "
            "remove rejection_sample_method from --speculative-config"
        )
    if method not in SPECULATIVE_METHODS:
        return (
            f"{option} is not supported by spyre-inference yet (supported: "
            f"{', '.join(SPECULATIVE_METHODS)}); use method='ngram' or remove "
            "--speculative-config"
        )
    if device.is_spyre():
        return (
            f"{option} has not been verified on a Spyre card; it is supported on the cpu "
            "target (SPYRE_DEVICE_TARGET=cpu). Remove --speculative-config"
        )
    if importlib.util.find_spec("numba") is None:
        return (
            f"{option} needs numba (vLLM's ngram proposer is compiled with it), which is "
            "not installed: pip install 'spyre-inference-platform[ngram]' (or numba)"
        )
    return None


def missing_packages(vllm_config: VllmConfig) -> list[str]:
    """What this configuration needs from sub-packages that vLLM will not load."""
    missing: list[str] = []
    parallel = vllm_config.parallel_config
    if parallel.tensor_parallel_size > 1 and "spyre" not in discovery.available(
        discovery.COMMUNICATORS_GROUP
    ):
        missing.append(
            f"tensor_parallel_size={parallel.tensor_parallel_size} needs the device "
            "communicator from 'spyre-inference-comms', which is not installed. "
            "pip install spyre-inference-comms (or the full set, spyre-inference)."
        )
    try:
        discovery.resolve_qualname(
            discovery.ATTENTION_BACKENDS_GROUP,
            settings.get("SPYRE_ATTN_KV_LAYOUT"),
            "the attention backend",
        )
    except discovery.MissingPackageError as exc:
        missing.append(str(exc))

    head_dim = stick_pad.head_dim_to_pad(vllm_config)
    if head_dim is not None and not discovery.general_plugin_enabled("spyre_ops"):
        missing.append(
            f"head_dim={head_dim} is not a multiple of the {STICK_ELEMS}-element "
            "Spyre stick; the ops package (general plugin spyre_ops) pads it, and the "
            "attention backends accept only whole sticks. To fix: "
            f"{discovery.how_to_enable('spyre_ops')}."
        )
    model_config = vllm_config.model_config
    if (
        model_config is not None
        and model_config.get_num_experts() > 0
        and not discovery.general_plugin_enabled("spyre_models")
    ):
        missing.append(
            f"{model_config.architecture} is a mixture-of-experts model; its experts run "
            "through the out-of-tree MoE method of the models package (general plugin "
            "spyre_models), vLLM's own needs compiled kernels that do not exist here. "
            f"To fix: {discovery.how_to_enable('spyre_models')}."
        )
    return missing


def check_packages(vllm_config: VllmConfig) -> None:
    """Fail naming every missing sub-package at once (one restart fixes them all)."""
    missing = missing_packages(vllm_config)
    if len(missing) == 1:
        raise discovery.MissingPackageError(missing[0])
    if missing:
        raise discovery.MissingPackageError(
            "spyre-inference needs sub-packages that are not loaded:\n"
            + "\n".join(f"  - {m}" for m in missing)
        )


def run_package_checks(vllm_config: VllmConfig) -> None:
    """The checks the installed sub-packages publish (entry-point group config_checks)."""
    for check in discovery.config_checks().values():
        check(vllm_config)


__all__ = [
    "ConfigError",
    "check_cpu_isa",
    "check_engine_options",
    "check_head_size",
    "check_packages",
    "missing_packages",
    "run_package_checks",
    "speculative_decoding_problem",
]
