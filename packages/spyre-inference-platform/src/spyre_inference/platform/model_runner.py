"""``TorchSpyreModelRunner``: vLLM's GPU model runner with Spyre as the "GPU".

The runner keeps ``self.device`` on the host so the scheduler's bookkeeping
(block tables, slot mapping, indexing) runs there; float compute lands on
``spyre_inference.platform.device.device()`` (spec, "Device Placement
Strategy"). On the cpu target both are the host, so the host/device buffer
pairs collapse to one tensor and no copy is made.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import Iterator
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import numpy as np
import torch
from torch import nn
from vllm.config import CompilationMode, VllmConfig, set_current_vllm_config
from vllm.distributed.parallel_state import get_pp_group
from vllm.lora.layers import LoRAMappingType
from vllm.model_executor.model_loader import get_model
from vllm.v1.kv_cache_interface import KVCacheConfig
from vllm.v1.utils import CpuGpuBuffer
from vllm.v1.worker.gpu_model_runner import GPUModelRunner
from vllm.v1.worker.utils import bind_kv_cache, map_kv_caches_to_kernel_blocks

from spyre_inference.platform import device as dev
from spyre_inference.platform import kv_allocation, layer_swaps, settings
from spyre_inference.platform.block_compile import CompileReport, compile_model
from spyre_inference.platform.buffers import SpyreCpuGpuBuffer, alias_host_buffers
from spyre_inference.platform.host_env import cuda_stream_placeholders, neutralize_cuda_runtime
from spyre_inference.platform.host_sampler import HostTopKTopPSampler
from spyre_inference.platform.logs import get_logger
from spyre_inference.platform.model_wrapper import _SpyreModelWrapper
from spyre_inference.platform.token_buckets import TokenBuckets
from spyre_inference.platform.warmup import (
    AttentionGroupPlan,
    AttentionWarmUpPlan,
    WarmsUpAttention,
    WarmUpStats,
    warm_up_buckets,
    warm_up_logprobs,
)

logger = get_logger(__name__)


class TorchSpyreModelRunner(GPUModelRunner):
    def __init__(self, vllm_config: VllmConfig, device: torch.device) -> None:
        neutralize_cuda_runtime()
        with cuda_stream_placeholders():
            super().__init__(vllm_config, device)
        self.use_cuda_graph = False
        self._spyre_device = dev.device()
        self.compiled = vllm_config.compilation_config.mode == CompilationMode.STOCK_TORCH_COMPILE
        self.token_buckets = TokenBuckets(
            self.max_num_tokens, lora=vllm_config.lora_config is not None
        )
        self.compile_report: CompileReport | None = None
        self.warm_up_stats: WarmUpStats | None = None
        self._wrapper: _SpyreModelWrapper | None = None
        # Buffers built by vLLM's input batch and block tables hold sampling
        # parameters and index bookkeeping: host data on both targets.
        alias_host_buffers(self)
        if dev.is_spyre() and self.enable_prompt_embeds:
            # vLLM writes embeddings into this buffer with host indices
            # (_preprocess), which a device tensor cannot take: the buffer stays
            # on the host and the model's input hook moves each step's rows.
            self.inputs_embeds.gpu = self.inputs_embeds.cpu
        if settings.get("SPYRE_SAMPLER") == "candidates":
            # vLLM picks its sampler by platform; without Triton and not its CPU
            # backend, that is the full-sort PyTorch path (see host_sampler).
            self.sampler.topk_topp_sampler = HostTopKTopPSampler(
                self.sampler.logprobs_mode, self.sampler.use_fp64_gumbel
            )

    # ---- buffers ---------------------------------------------------------

    def _make_buffer(
        self, *size: int | torch.SymInt, dtype: torch.dtype, numpy: bool = True
    ) -> CpuGpuBuffer:
        return SpyreCpuGpuBuffer(*size, dtype=dtype, with_numpy=numpy)

    # ---- model -----------------------------------------------------------

    def load_model(self, load_dummy_weights: bool = False, **kwargs: Any) -> None:
        if load_dummy_weights:
            raise ValueError("Dummy-weight reloading (elastic EP) is not supported on Spyre.")
        start = time.perf_counter()
        logger.info(
            "Loading model %s on the %s target", self.model_config.model, dev.target().value
        )
        # Layers' process_weights_after_loading (transposes, padding) runs
        # inside get_model, while the weights are still on the host.
        model = get_model(vllm_config=self.vllm_config)
        # Layers vLLM's out-of-tree registry cannot reach (plain nn.Modules),
        # swapped while the model is still on the host and nothing is compiled.
        with set_current_vllm_config(self.vllm_config):
            swapped = layer_swaps.swap_built_modules(model)
        if swapped:
            logger.info(
                "Swapped %d built layer(s): %s", len(swapped), sorted(set(swapped.values()))
            )
        if self.lora_config:
            # vLLM's LoRA layers wrap the swapped linears (LoRA's layer match
            # resolves out-of-tree classes) and add the adapters through the
            # platform's punica wrapper, before the blocks are compiled.
            model = self.load_lora_model(model, self.vllm_config, self.device)
        if dev.is_spyre():
            move_model_to_device(model)
        self.model = model
        self._wrapper = _SpyreModelWrapper(model)
        self.model_memory_usage = sum(p.numel() * p.element_size() for p in model.parameters())
        if self.compiled:
            self.compile_report = compile_model(model, num_shapes=len(self.token_buckets.sizes))
            self.compile_granularity = self.compile_report.granularity
        logger.info("Model loaded in %.1f s", time.perf_counter() - start)

    def reload_weights(self, *args: Any, **kwargs: Any) -> None:
        """vLLM's in-place reload, then every layer's derived weight copies.

        vLLM restores each layer's checkpoint layout, loads into it and re-runs
        the layer's post-load step, which covers the transposed weights. Copies
        a layer derives from a tensor it does not own (a tied LM head's
        transposed embedding) or keeps outside its parameters (the cpu
        target's float32 copies) are out of that reload's reach: each layer
        method that has such copies refreshes them here.
        """
        super().reload_weights(*args, **kwargs)
        refresh_derived_weights(self.get_model())

    def _model_forward(
        self,
        input_ids: torch.Tensor | None = None,
        positions: torch.Tensor | None = None,
        intermediate_tensors: Any = None,
        inputs_embeds: torch.Tensor | None = None,
        **model_kwargs: Any,
    ) -> Any:
        assert self._wrapper is not None
        return self._wrapper(
            input_ids=input_ids,
            positions=positions,
            intermediate_tensors=intermediate_tensors,
            inputs_embeds=inputs_embeds,
            **model_kwargs,
        )

    def _preprocess(self, *args: Any, **kwargs: Any) -> Any:
        if not (self.enable_prompt_embeds and dev.is_spyre()):
            return super()._preprocess(*args, **kwargs)
        with _embedding_through_the_device(self.model):
            return super()._preprocess(*args, **kwargs)

    # ---- KV cache --------------------------------------------------------

    def initialize_kv_cache_tensors(
        self,
        kv_cache_config: KVCacheConfig,
        kernel_block_sizes: list[int],
        kv_cache_allocation_context: AbstractContextManager | None = None,
    ) -> dict[str, torch.Tensor]:
        """The KV cache, as vLLM lays it out, in memory each target can use well.

        vLLM allocates one flat int8 buffer of zeros on ``self.device`` (the host
        here: the runner's bookkeeping device) and views it per layer; this keeps
        its views and binding and changes where the bytes live
        (:mod:`~spyre_inference.platform.kv_allocation`). Spec ("Attention
        Backend"): the cache is one dense tensor per layer *on Spyre*, and the
        card has no int8 tensors, so there the buffer is allocated on the device
        in the cache's float dtype. The cpu target takes zero pages from the
        kernel instead of writing gigabytes of zeros at start-up.
        """
        nbytes = kv_allocation.backing_size(kv_cache_config)
        with kv_cache_allocation_context or nullcontext():
            if dev.is_spyre():
                backing = kv_allocation.device_backing(nbytes, dev.device(), self.kv_cache_dtype)
            else:
                backing = kv_allocation.zeroed_host_backing(nbytes)
        kv_caches = kv_allocation.kv_cache_views(
            kv_cache_config,
            backing,
            self.cache_config.get_resolved_kv_cache_layout(),
            kernel_block_sizes,
        )
        for layer_name, target_layer_name in self.shared_kv_cache_layers.items():
            kv_caches[layer_name] = kv_caches[target_layer_name]
        # As GPUModelRunner.initialize_kv_cache_tensors binds them (vLLM 0.33).
        num_attn_module = 2 if self.model_config.hf_config.model_type == "longcat_flash" else 1
        attn_groups = [g for groups in self.attn_groups for g in groups]
        if self.speculative_config:
            attn_groups += getattr(self.drafter, "draft_attn_groups", [])
        bind_kv_cache(
            kv_caches,
            self.compilation_config.static_forward_context,
            self.kv_caches,
            num_attn_module,
            kv_cache_groups=kv_cache_config.kv_cache_groups,
            layer_kv_caches=map_kv_caches_to_kernel_blocks(kv_caches, attn_groups),
        )
        return kv_caches

    # ---- shapes ----------------------------------------------------------

    def _determine_batch_execution_and_padding(self, num_tokens: int, *args: Any, **kwargs: Any):
        mode, desc, ubatch, across_dp, stats = super()._determine_batch_execution_and_padding(
            num_tokens, *args, **kwargs
        )
        if self.compiled:
            # Block graphs are specialized to one num_tokens each: run the
            # step at its bucket (the padding rows are masked out).
            desc = dataclasses.replace(desc, num_tokens=self.token_buckets.pad(num_tokens))
        return mode, desc, ubatch, across_dp, stats

    def set_active_loras(
        self,
        input_batch: Any,
        num_scheduled_tokens: np.ndarray,
        num_sampled_tokens: np.ndarray | None = None,
        mapping_type: LoRAMappingType = LoRAMappingType.LANGUAGE,
    ) -> None:
        """vLLM's per-token adapter mapping, extended over the bucket's padding rows.

        vLLM maps exactly the scheduled tokens, but a compiled step runs at its
        num_tokens bucket, and the LoRA layers (the host punica wrapper's
        segment ops) need one mapping entry per row they see: the padding rows
        get adapter id 0, no adapter.
        """
        scheduled = int(num_scheduled_tokens.sum())
        pad = (self.token_buckets.pad(scheduled) if self.compiled else scheduled) - scheduled
        if pad <= 0:
            super().set_active_loras(
                input_batch, num_scheduled_tokens, num_sampled_tokens, mapping_type
            )
            return
        if num_sampled_tokens is None:
            num_sampled_tokens = np.ones_like(num_scheduled_tokens, dtype=np.int32)
        prompt_mapping, token_mapping, requests = input_batch.make_lora_inputs(
            num_scheduled_tokens, num_sampled_tokens
        )
        self._set_active_loras(prompt_mapping, token_mapping + (0,) * pad, requests, mapping_type)

    def _attention_warm_up_plan(self) -> AttentionWarmUpPlan:
        """What the attention backends read at warm-up (the typed contract)."""
        groups = tuple(
            AttentionGroupPlan(g.backend, tuple(g.layer_names), g.get_metadata_builder())
            for groups in self.attn_groups
            for g in groups
        )
        context = self.vllm_config.compilation_config.static_forward_context
        names = {name for g in groups for name in g.layer_names}
        return AttentionWarmUpPlan(
            groups=groups,
            layers={name: layer for name, layer in context.items() if name in names},
            token_buckets=tuple(self.token_buckets.sizes),
            model_dtype=self.model_config.dtype,
        )

    def warm_up(self) -> None:
        """Compile everything serving can reach, so no request pays a compile.

        See :mod:`spyre_inference.platform.warmup`: attention kernel variants
        (recorded by the attention package), every num_tokens bucket of the
        compiled blocks, and vLLM's compiled logprobs helper.
        """
        # ---- attention kernels (spyre-inference-attention) -----------------
        # Each attention backend class records its own kernel variants. Also
        # in eager mode on purpose: the head-major backend compiles attention
        # even under --enforce-eager. Backends are reached through
        # the attention groups, never imported by name.
        plan = self._attention_warm_up_plan()
        for backend in dict.fromkeys(group.backend for group in plan.groups):
            if isinstance(backend, WarmsUpAttention):
                backend.warm_up(plan)
        # ---- end attention kernels -----------------------------------------
        # Block graphs (or the whole-model graph): one dummy step per
        # num_tokens bucket, padded exactly as a served step is.
        if self.compiled and self.compile_report is not None:
            self.warm_up_stats = warm_up_buckets(
                self.compile_report,
                self.token_buckets.sizes,
                lambda n: self._dummy_run(n, skip_eplb=True, remove_lora=False),
            )
            if settings.get("SPYRE_SETTLED_GUARDS") and self._wrapper is not None:
                self._wrapper.guards.arm(
                    self.token_buckets.sizes, self.compile_report.total_artifacts
                )
        if not get_pp_group().is_first_rank and self.intermediate_tensors is None:
            # A later pipeline stage receives into this buffer; vLLM allocates
            # it in its dummy step, which eager mode (--enforce-eager) never runs.
            self.intermediate_tensors = self.model.make_empty_intermediate_tensors(
                batch_size=self.max_num_tokens,
                dtype=self.model_config.dtype,
                device=self.device,
            )
        # vLLM compiles its logprobs helper whatever the compilation mode; do
        # it now rather than on the first request that asks for logprobs.
        if not self.is_pooling_model and get_pp_group().is_last_rank:
            # Its two rows go through the LM head, which LoRA wraps: map them
            # to (dummy) adapters as vLLM's own dummy runs do.
            rows = np.ones(2, dtype=np.int32)
            with self.maybe_dummy_run_with_lora(self.lora_config, rows, rows):
                seconds = warm_up_logprobs(
                    self.model.compute_logits,
                    self.model_config.get_hidden_size(),
                    self.model_config.dtype,
                    self.device,
                )
            logger.info("Warm-up: sampler logprobs helper ready in %.1f s", seconds)

    # ---- seeded sampling on host generators -------------------------------

    def _discarded_generators(self) -> dict[int, torch.Generator]:
        """Per-request generators of the rows whose sample this step throws away.

        Those are requests still mid-prefill (a chunk that is not their last)
        batched with requests that do sample.
        """
        num_reqs = self.input_batch.num_reqs
        generators = self.input_batch.generators
        rows = self.discard_request_mask.np[:num_reqs].nonzero()[0]
        return {int(i): generators[int(i)] for i in rows if int(i) in generators}

    def _sample(self, logits: torch.Tensor | None, spec_decode_metadata: Any) -> Any:
        # The sampler draws for every row, including rows whose token is then
        # discarded. vLLM undoes that draw by rewinding the CUDA (Philox)
        # generator's offset; host generators (the only kind here: sampling
        # runs on the host on both targets) have no offset, so the state is
        # saved and put back instead. A seed then yields the same tokens
        # however the prompt was chunked and whatever shared its steps.
        saved = {i: gen.get_state() for i, gen in self._discarded_generators().items()}
        output = super()._sample(logits, spec_decode_metadata)
        generators = self.input_batch.generators
        for i, state in saved.items():
            generators[i].set_state(state)
        return output

    def _bookkeeping_sync(self, *args: Any, **kwargs: Any) -> Any:
        # vLLM's bookkeeping calls Generator.get_offset()/set_offset() on the
        # discarded rows' generators, which raises for host generators
        # ("CPU Generator does not use offset"). _sample has already restored
        # them, so they are kept out of vLLM's sight for this call.
        hidden = self._discarded_generators()
        generators = self.input_batch.generators
        for i in hidden:
            del generators[i]
        try:
            return super()._bookkeeping_sync(*args, **kwargs)
        finally:
            generators.update(hidden)

    # ---- CUDA-only pieces ------------------------------------------------

    def _sync_device(self) -> None:
        return None

    def _to_list(self, sampled_token_ids: torch.Tensor) -> list[list[int]]:
        # The sampler runs on the host: no event to wait for.
        return sampled_token_ids.tolist()

    def _zero_block_ids(self, block_ids: list[int]) -> None:
        """Zero freshly allocated KV blocks so stale values never enter a softmax."""
        if not block_ids:
            return
        idx = torch.tensor(block_ids, dtype=torch.int64)
        seen: set[int] = set()
        for kv in self.kv_caches:
            tensors = kv if isinstance(kv, (list, tuple)) else [kv]
            for t in tensors:
                if not isinstance(t, torch.Tensor) or t.data_ptr() in seen:
                    continue
                seen.add(t.data_ptr())
                _zero_blocks(t, idx, self.kv_cache_config.num_blocks)


@contextlib.contextmanager
def _embedding_through_the_device(model: nn.Module) -> Iterator[None]:
    """``model.embed_input_ids`` taking host ids and returning host rows, for one call.

    With prompt embeddings vLLM embeds a batch's token-id rows itself, outside
    the model call and its conversions (``GPUModelRunner._preprocess`` calls
    ``self.model.embed_input_ids`` with the runner's host ids and writes the
    rows into the host ``inputs_embeds`` buffer); on the card path the table is
    on the device. vLLM offers no hook there, so the method is shadowed on the
    instance for the duration of that call only.
    """
    embed = model.embed_input_ids

    def embed_on_the_device(input_ids: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        return dev.to_host(embed(dev.to_device(input_ids, dtype=torch.int64), **kwargs))

    model.embed_input_ids = embed_on_the_device
    try:
        yield
    finally:
        del model.embed_input_ids


def _zero_blocks(t: torch.Tensor, idx: torch.Tensor, num_blocks: int) -> None:
    # The block axis is the one whose size is num_blocks (K/V may be stacked
    # ahead of it, depending on the backend's layout).
    for dim, size in enumerate(t.shape):
        if size == num_blocks:
            t.index_fill_(dim, dev.to_device(idx) if t.device != idx.device else idx, 0)
            return


def move_model_to_device(model: nn.Module) -> None:
    """Move the model to the card, except Attention scale buffers and buffers of a
    dtype the card cannot hold.

    Spec: "load_model moves every module except Attention scale buffers onto
    Spyre" — those scales are read on the host by the attention metadata path.
    A bool or small-integer buffer stays on the host too (the card has no such
    tensors): Hugging Face's GPT-BigCode keeps a legacy ``[max_pos, max_pos]``
    bool mask its forward no longer reads. One a forward does read then fails
    as a host tensor meeting device ones, not as an allocation.
    """
    from vllm.model_executor.layers.attention import Attention

    kept: list[str] = []
    for module_name, module in model.named_modules():
        keep_on_host = isinstance(module, Attention)
        for param in module.parameters(recurse=False):
            param.data = dev.to_device(param.data)
        for name, buf in list(module.named_buffers(recurse=False)):
            if keep_on_host and "scale" in name:
                continue
            if buf is not None and not dev.placeable_on_device(buf.dtype):
                kept.append(f"{module_name}.{name} ({buf.dtype})")
                continue
            module._buffers[name] = dev.to_device(buf)
    if kept and dev.is_spyre():
        logger.info("Buffers kept on the host (the card holds no bool/small ints): %s", kept)


def refresh_derived_weights(model: torch.nn.Module) -> None:
    """Call ``refresh_after_weight_update(layer)`` of every layer method that has one.

    A duck-typed hook (the layer methods live in packages that depend on this
    one): see ``spyre_inference.ops.SpyreTransposedWeightMethod``.
    """
    for module in model.modules():
        method = getattr(module, "quant_method", None)
        refresh = getattr(method, "refresh_after_weight_update", None)
        if refresh is not None:
            refresh(module)
