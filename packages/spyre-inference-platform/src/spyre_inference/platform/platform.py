"""``TorchSpyrePlatform``: how vLLM sees a Spyre card (or the cpu target).

vLLM resolves exactly one platform per process; this class is what the
``vllm.platform_plugins`` entry point names. It owns the config rules of the
spec (dtype, block size, parallelism, compilation mode, worker class) and
points vLLM at the worker, attention backends and communicator, the latter two
discovered through the core's own entry-point groups.
"""

from __future__ import annotations

import os
import sys
from typing import TYPE_CHECKING

import torch
from vllm.platforms.interface import Platform, PlatformEnum

from spyre_inference.platform import (
    cpu_allocator,
    discovery,
    float16_models,
    mamba_checks,
    serve_exit,
    settings,
    startup_checks,
    stick_pad,
)
from spyre_inference.platform import device as dev
from spyre_inference.platform.host_env import neutralize_cuda_runtime
from spyre_inference.platform.logs import get_logger
from spyre_inference.platform.startup_checks import ConfigError

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.attention.backends.registry import AttentionBackendEnum
    from vllm.v1.attention.selector import AttentionSelectorConfig

logger = get_logger(__name__)

#: Spec: "The default is 128, and a user-supplied block_size is rounded up to
#: the next multiple of 64" (a KV page must be whole 64-element sticks).
DEFAULT_BLOCK_SIZE = 128

#: Attention backend entry-point names (group spyre_inference.attention_backends).
TOKEN_MAJOR = "token_major"
HEAD_MAJOR = "head_major"
ENCODER = "encoder"

WORKER_QUALNAME = "spyre_inference.platform.worker.TorchSpyreWorker"
BUCKET_SCHEDULER_QUALNAME = "spyre_inference.platform.bucket_scheduler.BucketAlignedScheduler"
BASE_COMMUNICATOR = (
    "vllm.distributed.device_communicators.base_device_communicator.DeviceCommunicatorBase"
)


def _in_ray_worker() -> bool:
    import ray

    return ray.is_initialized() and ray.get_runtime_context().worker.mode == ray.WORKER_MODE


class TorchSpyrePlatform(Platform):
    _enum = PlatformEnum.OOT
    device_name: str = "spyre"  # per target, see __init__
    # The runner's ``self.device`` stays on the host on both targets: block
    # tables, slot mappings and other index bookkeeping run there (spec,
    # "Device Placement Strategy"); float compute goes to ``device.device()``.
    device_type: str = "cpu"
    dispatch_key: str = "CPU"
    # gloo serves the host half of collectives on both targets; on a card the
    # comms package adds the spyreccl half to the process group.
    dist_backend: str = "gloo"
    simple_compile_backend: str = "inductor"
    supported_quantization: list[str] = []
    # The Ray resource one rank reserves under --distributed-executor-backend ray
    # (ray_executor.SpyreAcceleratorManager: a card, or a host core on the cpu target).
    ray_device_key: str = "spyre"

    def __init__(self) -> None:
        # vLLM builds torch.device(f"{device_name}:{index}") for process
        # groups, so the name must be a torch device type: "spyre" (registered
        # by torch-spyre) on the card, "cpu" on the host target.
        self.device_name = dev.device().type
        # vLLM registers its custom ops (attention, MoE, collectives) for this
        # dispatch key. On the card path they are called with device tensors,
        # whose key is torch-spyre's PrivateUse1; registered for CPU they would
        # only be reachable through a backend fallback that hands them host
        # tensors.
        self.dispatch_key = "PrivateUse1" if dev.is_spyre() else "CPU"
        if dev.target() is dev.DeviceTarget.CPU:
            # The host has no torch accelerator, so vLLM's unconditional
            # torch.accelerator.empty_cache() calls (an engine core without an
            # in-process worker runs one at shutdown, cleanup_dist_env_and_memory)
            # could only raise; the worker neutralizes them on every target.
            neutralize_cuda_runtime()
        if "ray" in sys.modules and _in_ray_worker():
            # A worker of vLLM's Ray executor resolves the platform just before
            # asking Ray for its share of the "spyre" resource (ray_resource).
            from spyre_inference.platform.ray_resource import register_with_ray

            register_with_ray()

    @property
    def supported_dtypes(self) -> list[torch.dtype]:
        return list(dev.allowed_dtypes())

    # ---- device queries -------------------------------------------------

    @classmethod
    def get_device_name(cls, device_id: int = 0) -> str:
        return f"spyre ({dev.target().value} target)"

    @classmethod
    def get_device_total_memory(cls, device_id: int = 0) -> int:
        import psutil

        return int(psutil.virtual_memory().total)

    @classmethod
    def get_current_memory_usage(cls, device: torch.types.Device | None = None) -> float:
        import psutil

        return float(psutil.Process().memory_info().rss)

    @classmethod
    def set_device(cls, device: torch.device) -> None:
        # Nothing to select: one card (or the host) per worker process.
        return None

    @classmethod
    def manual_seed_all(cls, seed: int) -> None:
        # torch.manual_seed (called by vLLM's set_random_seed) seeds the host
        # generator, which is the one every sampling op uses on both targets
        # (logits are moved to the host before sampling).
        return None

    @classmethod
    def inference_mode(cls):
        return torch.no_grad()

    @classmethod
    def is_sleep_mode_available(cls) -> bool:
        # Reported available so that vLLM's own generic refusal ("not supported
        # on current platform") does not pre-empt the start-up check, which
        # refuses --enable-sleep-mode with the reason and the fix
        # (startup_checks.check_engine_options).
        return True

    @classmethod
    def is_pin_memory_available(cls) -> bool:
        # Pinned host memory is a CUDA concept; torch-spyre does not use it.
        return False

    @classmethod
    def import_kernels(cls) -> None:
        # vLLM is built with VLLM_TARGET_DEVICE=empty: there is no vllm._C.
        return None

    @classmethod
    def opaque_attention_op(cls) -> bool:
        # Attention runs behind vLLM's unified_attention_with_output custom op
        # so compiled block graphs never trace into it (spec, "Compilation
        # Granularity": attention compiles its own kernels).
        return True

    @classmethod
    def support_hybrid_kv_cache(cls) -> bool:
        # Mamba models need vLLM's hybrid KV-cache manager for their states;
        # every other model is kept on one cache group in
        # check_and_update_config (mamba_checks.choose_kv_cache_manager).
        return True

    @classmethod
    def supports_structured_output(cls) -> bool:
        return True

    @classmethod
    def num_compute_units(cls, device_id: int = 0) -> int:
        return torch.get_num_threads()

    @classmethod
    def register_triton_kernel_overrides(cls) -> None:
        # Without compiled kernels, vLLM's Triton kernels have no backend
        # here; route them to pure-PyTorch implementations.
        from vllm.triton_utils.dispatcher import register_kernels

        from spyre_inference.platform.rejection_kernels import OVERRIDES
        from spyre_inference.platform.slot_mapping import compute_slot_mapping_kernel

        kernel = "vllm.v1.worker.block_table.ComputeSlotMappingKernel.kernel"
        # Speculative decoding's rejection sampler: PyTorch stand-ins on the host.
        register_kernels({kernel: compute_slot_mapping_kernel, **OVERRIDES})

    # ---- component selection --------------------------------------------

    @classmethod
    def get_attn_backend_cls(
        cls,
        selected_backend: AttentionBackendEnum | None,
        attn_selector_config: AttentionSelectorConfig,
        num_heads: int | None = None,
    ) -> str:
        from vllm.v1.attention.backend import AttentionType

        cfg = attn_selector_config
        if cfg.use_mla or cfg.use_sparse:
            raise NotImplementedError(
                "spyre-inference has no MLA or sparse attention backend; models such as "
                "DeepSeek-V2/V3 are not supported."
            )
        if cfg.attn_type in (AttentionType.ENCODER, AttentionType.ENCODER_ONLY):
            name = ENCODER
        else:
            name = settings.get("SPYRE_ATTN_KV_LAYOUT")
        qualname = discovery.resolve_qualname(
            discovery.ATTENTION_BACKENDS_GROUP, name, "the attention backend"
        )
        logger.info("spyre-inference attention backend: %s (%s)", name, qualname)
        return qualname

    @classmethod
    def get_device_communicator_cls(cls) -> str:
        if "spyre" in discovery.available(discovery.COMMUNICATORS_GROUP):
            return discovery.resolve_qualname(
                discovery.COMMUNICATORS_GROUP, "spyre", "the device communicator"
            )
        # Only reachable at TP=1 (check_and_update_config rejects TP>1
        # without the comms package), where no collective is ever issued.
        return BASE_COMMUNICATOR

    @classmethod
    def get_punica_wrapper(cls) -> str:
        # vLLM's CPU punica wrapper computes the adapters' shrink/expand with
        # plain torch ops (vllm.lora.ops.torch_ops): host compute, which is what
        # the cpu target runs. The card path refuses LoRA at start-up.
        return "vllm.lora.punica_wrapper.punica_cpu.PunicaWrapperCPU"

    # ---- config rules ----------------------------------------------------

    @classmethod
    def pre_register_and_update(cls, parser=None) -> None:
        # Bad plugin settings fail before anything is built.
        settings.validate_all()
        if parser is None and dev.is_spyre():
            # Before vLLM builds the model config (create_engine_config): the
            # card's only dtype must not be refused for Gemma 2/3 and GLM-4.
            float16_models.allow_on_card_path()
        if parser is not None:
            # vLLM's CLI (vllm serve): exit non-zero if the engine dies later.
            serve_exit.arm()

    @classmethod
    def check_and_update_config(cls, vllm_config: VllmConfig) -> None:
        from vllm.config import CompilationMode, CUDAGraphMode

        settings.validate_all()
        serve_exit.rearm()
        choice = dev.target_choice()

        parallel = vllm_config.parallel_config
        if parallel.data_parallel_size > 1:
            raise ConfigError(
                f"data_parallel_size={parallel.data_parallel_size} is not supported by "
                "spyre-inference: run one server per card instead, or use "
                "--tensor-parallel-size to span cards. Remove --data-parallel-size."
            )
        if parallel.pipeline_parallel_size > 1 and dev.is_spyre():
            # The stages' send/recv has run over gloo on the cpu target only; on
            # the card it would go through the Spyre communicator's point-to-point
            # path, which no test has exercised yet.
            raise ConfigError(
                f"pipeline_parallel_size={parallel.pipeline_parallel_size} has not been "
                "verified on the Spyre card path (only on the cpu target, "
                "SPYRE_DEVICE_TARGET=cpu); use --tensor-parallel-size to span cards."
            )
        # Fail here, in the process the user started, rather than in an
        # engine subprocess whose traceback only reaches the log.
        startup_checks.check_head_size(vllm_config)
        startup_checks.check_cpu_isa()
        startup_checks.check_engine_options(vllm_config)
        startup_checks.check_packages(vllm_config)
        startup_checks.run_package_checks(vllm_config)
        startup_checks.check_host_memory(vllm_config)
        problem = mamba_checks.choose_kv_cache_manager(vllm_config)
        if problem:
            raise ConfigError(problem + ".")
        if parallel.worker_cls == "auto":
            parallel.worker_cls = WORKER_QUALNAME
        if parallel.distributed_executor_backend == "ray":
            cls._use_spyre_ray_executor(vllm_config)
        # The engine's mp executor must spawn, not fork: the parent may hold
        # an initialised OpenMP pool / Inductor worker threads.
        os.environ.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")
        if choice.target is dev.DeviceTarget.CPU:
            cpu_allocator.preload_tcmalloc()

        model_config = vllm_config.model_config
        if model_config is not None:
            cls._check_dtype(model_config.dtype, choice.target)
            cache_dtype = vllm_config.cache_config.cache_dtype
            if (
                cache_dtype not in ("auto", None)
                and getattr(torch, str(cache_dtype), None) != model_config.dtype
            ):
                raise ConfigError(
                    f"--kv-cache-dtype {cache_dtype} is not supported: the Spyre KV cache is "
                    f"kept in the model dtype ({model_config.dtype}). Remove --kv-cache-dtype "
                    "or set it to auto."
                )

        if discovery.general_plugin_enabled("spyre_ops"):
            # Head and MLP widths become whole sticks before the model is built;
            # the ops package's weight loaders zero-pad the checkpoint to match.
            stick_pad.widen_config(vllm_config)
        cls._set_block_size(vllm_config)

        # Scheduling: the runner is synchronous (no CUDA streams to overlap).
        vllm_config.scheduler_config.async_scheduling = False

        compilation = vllm_config.compilation_config
        compilation.cudagraph_mode = CUDAGraphMode.NONE
        compilation.cudagraph_capture_sizes = []
        if model_config is not None and model_config.enforce_eager:
            compilation.mode = CompilationMode.NONE
        else:
            # Spec: blocks are compiled by the runner with stock torch.compile
            # (Inductor, dynamic=False); vLLM's own piecewise pipeline is not used.
            compilation.mode = CompilationMode.STOCK_TORCH_COMPILE
            cls._align_prefill_to_buckets(vllm_config)
        # vLLM IR ops (RMSNorm, fused add + RMSNorm) call their native PyTorch
        # body directly instead of going through an opaque torch custom op:
        # only vLLM's own Inductor pipeline lowers those ops, so under stock
        # torch.compile they stayed opaque and ran eagerly inside every block
        # graph (two eager norms per layer; on the card, eager launches).
        # vLLM resolves the default before this hook changes the mode.
        compilation.ir_enable_torch_wrap = False

    @classmethod
    def _align_prefill_to_buckets(cls, vllm_config: VllmConfig) -> None:
        """Schedule with step budgets cut at bucket edges (``bucket_scheduler``).

        Only compiled steps are padded to a bucket, and only chunked prefill lets
        the scheduler split a prompt; a scheduler the user named is kept.
        """
        scheduler = vllm_config.scheduler_config
        if (
            settings.get("SPYRE_BUCKET_ALIGNED_PREFILL")
            and scheduler.enable_chunked_prefill
            and scheduler.scheduler_cls is None
        ):
            scheduler.scheduler_cls = BUCKET_SCHEDULER_QUALNAME

    @classmethod
    def _use_spyre_ray_executor(cls, vllm_config: VllmConfig) -> None:
        """Swap in vLLM's Ray executor subclass that makes Ray know the ``spyre``
        resource (``ray_executor``); vLLM has already checked that ray imports."""
        from spyre_inference.platform.ray_executor import SpyreRayExecutor, check_cluster_fits

        parallel = vllm_config.parallel_config
        if parallel.placement_group is None:
            check_cluster_fits(parallel.world_size)
        parallel.distributed_executor_backend = SpyreRayExecutor

    @classmethod
    def _check_dtype(cls, dtype: torch.dtype, target: dev.DeviceTarget) -> None:
        allowed = dev.allowed_dtypes(target)
        if dtype not in allowed:
            names = ", ".join(str(d).removeprefix("torch.") for d in allowed)
            hint = (
                "The Spyre card computes in float16 only"
                if target is not dev.DeviceTarget.CPU
                else "The cpu target computes in bfloat16 (default), float16 or float32"
            )
            raise ConfigError(
                f"--dtype {str(dtype).removeprefix('torch.')} is not supported on the "
                f"{target.value} target. {hint}: pass --dtype with one of {names}."
            )

    @classmethod
    def _set_block_size(cls, vllm_config: VllmConfig) -> None:
        cache = vllm_config.cache_config
        if cache.user_specified_block_size:
            aligned = dev.round_up(cache.block_size)
            if aligned != cache.block_size:
                logger.warning(
                    "block_size=%d is not a multiple of the %d-element Spyre stick; "
                    "rounding up to %d.",
                    cache.block_size,
                    dev.STICK_ELEMS,
                    aligned,
                )
                cache.block_size = aligned
        else:
            cache.block_size = DEFAULT_BLOCK_SIZE

    @classmethod
    def check_if_supports_dtype(cls, dtype: torch.dtype) -> None:
        cls._check_dtype(dtype, dev.target())
