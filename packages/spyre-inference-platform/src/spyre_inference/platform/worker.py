"""``TorchSpyreWorker``: vLLM's GPU worker with the CUDA-only pieces replaced.

It inherits from vLLM's ``gpu_worker.Worker`` (not ``CPUWorker``): Spyre needs
none of the CPU backend's NUMA binding or OpenMP set-up, and the GPU worker is
the one whose control flow (load, profile, allocate KV, warm up, execute) the
card follows. What is CUDA-specific — device selection, memory snapshots and
profiling, cumem memory pools, CUDA-graph capture, sleep mode — is overridden
here.
"""

from __future__ import annotations

import dataclasses
import os
import time
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import psutil
import torch
from vllm.config import VllmConfig
from vllm.utils.torch_utils import set_random_seed
from vllm.v1.worker.gpu_worker import Worker, init_worker_distributed_environment
from vllm.v1.worker.worker_base import CompilationTimes

from spyre_inference.platform import device as dev
from spyre_inference.platform.host_env import neutralize_cuda_runtime
from spyre_inference.platform.logs import get_logger
from spyre_inference.platform.memory_plan import (
    StepShape,
    peak_rss_bytes,
    plan_host_kv,
    step_reserve,
    step_shape,
)

logger = get_logger(__name__)

GiB = 1 << 30


def host_threads(world_size: int) -> int:
    """Compute threads per worker on the cpu target (OMP_NUM_THREADS wins)."""
    explicit = os.environ.get("OMP_NUM_THREADS")
    # vLLM's process launcher may set OMP_NUM_THREADS=1 itself (and says so
    # in this marker); only a user's own value counts.
    if os.environ.get("VLLM_OMP_NUM_THREADS_SET_BY_VLLM") == "1":
        explicit = None
    if explicit and explicit.isdigit() and int(explicit) > 0:
        return int(explicit)
    cores = len(os.sched_getaffinity(0))
    return max(1, cores // max(1, world_size))


class TorchSpyreWorker(Worker):
    def __init__(
        self,
        vllm_config: VllmConfig,
        local_rank: int,
        rank: int,
        distributed_init_method: str,
        is_driver_worker: bool = False,
    ) -> None:
        neutralize_cuda_runtime()
        super().__init__(
            vllm_config,
            local_rank,
            rank,
            distributed_init_method,
            is_driver_worker=is_driver_worker,
        )
        # vLLM's custom all-reduce is a CUDA IPC kernel.
        self.parallel_config.disable_custom_all_reduce = True

    def init_device(self) -> None:
        choice = dev.target_choice()
        # The runner's bookkeeping device is the host on both targets; float
        # compute is placed by spyre_inference.platform.device.
        self.device = torch.device("cpu")
        from spyre_inference.platform.platform import TorchSpyrePlatform

        TorchSpyrePlatform.check_if_supports_dtype(self.model_config.dtype)
        if dev.has_card():
            # torch-spyre's collective library reads the rank environment when
            # it loads; set it before the process group is created.
            from spyre_inference.platform.distributed_env import export_rank_env

            export_rank_env(self.rank, self.local_rank, self.parallel_config.world_size)
        init_worker_distributed_environment(
            self.vllm_config,
            self.rank,
            self.distributed_init_method,
            self.local_rank,
            # Spec, "Distributed (TP)": on a card the group is multi-backend
            # (gloo for host tensors, spyreccl for device tensors); on the cpu
            # target gloo serves both halves.
            "cpu:gloo,spyre:spyreccl" if dev.has_card() else "gloo",
        )
        set_random_seed(self.model_config.seed)
        logger.info(
            "TorchSpyreWorker rank %d on the %s target (%s)",
            self.rank,
            choice.target.value,
            choice.reason,
        )
        self._init_workspace_and_model_runner()

    def _make_model_runner(self):
        from spyre_inference.platform.model_runner import TorchSpyreModelRunner

        return TorchSpyreModelRunner(self.vllm_config, self.device)

    def load_model(self, *args: Any, **kwargs: Any) -> None:
        super().load_model(*args, **kwargs)
        if not dev.has_card():
            # vLLM drops torch to one intra-op thread for serving because on
            # a GPU no host op benefits from more. On the cpu target the host
            # *is* the compute device: give each worker its share of the cores
            # (before warm-up, so Dynamo's thread-count guards stay valid).
            threads = host_threads(self.parallel_config.world_size)
            torch.set_num_threads(threads)
            logger.info("%d torch threads for host compute", threads)

    def _maybe_get_memory_pool_context(self, tag: str) -> AbstractContextManager:
        # cumem pools are a CUDA allocator feature (sleep mode); not here.
        return nullcontext()

    @torch.inference_mode()
    def determine_available_memory(self) -> int:
        """Bytes for the KV cache.

        An explicit ``--kv-cache-memory-bytes`` wins. The card path budgets the
        card's memory. On the host (:mod:`~spyre_inference.platform.memory_plan`):
        ``gpu_memory_utilization`` of the host minus what this process holds, as
        vLLM's CPU backend does, but never more than what is available after a
        reserve for warm-up and the largest step, and no more than what
        ``max_num_seqs`` full-length sequences use (twice over, for prefix-cache
        reuse): host memory the cache does not take stays useful to the machine.
        """
        explicit = self.cache_config.kv_cache_memory_bytes
        if explicit:
            return int(explicit)
        if dev.is_spyre():
            return self._device_kv_budget()
        vm = psutil.virtual_memory()
        self.memory_plan = plan_host_kv(
            total=vm.total,
            available=vm.available,
            worker_rss=psutil.Process().memory_info().rss,
            utilization=self.cache_config.gpu_memory_utilization,
            reserve=step_reserve(self._step_shape()),
            full_batch_kv=2 * self._bytes_for_full_batch(),
            one_sequence_kv=self._bytes_for_one_sequence(),
        )
        logger.info("Host memory plan: %s", self.memory_plan.describe())
        return self.memory_plan.kv_bytes

    def memory_report(self) -> dict[str, Any]:
        """The host-memory plan and this process's peak RSS so far (bytes).

        For ``LLM.collective_rpc("memory_report")``: tests check the plan
        covered what warm-up and serving really used.
        """
        plan = getattr(self, "memory_plan", None)
        return {
            "plan": dataclasses.asdict(plan) if plan is not None else None,
            "reserve_bytes": plan.reserve_bytes if plan is not None else None,
            "peak_rss": peak_rss_bytes(),
        }

    def _step_shape(self) -> StepShape:
        # A compiled step runs at its num_tokens bucket, which may exceed
        # max_num_batched_tokens.
        buckets = getattr(self.model_runner, "token_buckets", None)
        max_tokens = max(buckets.sizes) if buckets else self.scheduler_config.max_num_batched_tokens
        return step_shape(self.vllm_config, max_tokens)

    def _device_kv_budget(self) -> int:
        """The card path: ``gpu_memory_utilization`` of the *device's* memory.

        As vLLM does on a GPU: the share of the card's memory the user grants,
        minus what the model and warm-up already hold on it. Host RAM says
        nothing about the card.
        """
        free, total = dev.device_memory_info()
        in_use = total - free
        budget = int(total * self.cache_config.gpu_memory_utilization) - in_use
        if budget <= 0:
            raise ValueError(
                f"No device memory left for the KV cache: {in_use / GiB:.2f} GiB of the "
                f"card's {total / GiB:.2f} GiB are in use and gpu_memory_utilization="
                f"{self.cache_config.gpu_memory_utilization} grants "
                f"{total * self.cache_config.gpu_memory_utilization / GiB:.2f} GiB. Raise "
                "--gpu-memory-utilization or pass --kv-cache-memory-bytes."
            )
        logger.info(
            "KV cache budget %.3f GiB (device %.2f GiB, in use %.3f GiB)",
            budget / GiB,
            total / GiB,
            in_use / GiB,
        )
        return budget

    def _bytes_for_one_sequence(self) -> int:
        specs = self.model_runner.get_kv_cache_spec()
        max_len = self.model_config.max_model_len
        return sum(s.page_size_bytes * -(-max_len // s.block_size) for s in specs.values())

    def _bytes_for_full_batch(self) -> int:
        specs = self.model_runner.get_kv_cache_spec()
        if not specs:
            return 0
        max_len = self.model_config.max_model_len
        seqs = self.scheduler_config.max_num_seqs
        total = 0
        for spec in specs.values():
            page = spec.page_size_bytes
            blocks_per_seq = -(-max_len // spec.block_size)
            total += page * (blocks_per_seq * seqs + 1)
        return total

    def compile_or_warm_up_model(self) -> CompilationTimes:
        start = time.perf_counter()
        self.model_runner.warm_up()
        elapsed = time.perf_counter() - start
        # Reset the seed so warm-up does not shift the sampling RNG.
        set_random_seed(self.model_config.seed)
        return CompilationTimes(language_model=elapsed, encoder=0.0)

    def sleep(self, level: int = 1) -> None:
        logger.warning("Sleep mode is not supported by spyre-inference; ignoring.")

    def wake_up(self, tags: list[str] | None = None) -> None:
        logger.warning("Sleep mode is not supported by spyre-inference; ignoring.")
