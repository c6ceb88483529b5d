"""The KV cache's backing memory on the card path.

vLLM (``vllm.v1.worker.utils.allocate_kv_cache``) backs every layer's cache
with one flat ``int8`` buffer and takes per-layer views of it. On the card the
cache must live on the device, which has no ``int8`` tensors, so the buffer is
allocated there in the cache's float dtype and reinterpreted as bytes only to
take vLLM's own per-layer views (:func:`create_kv_cache_views`): the layouts,
strides and cross-group overlays stay exactly vLLM's.
"""

from __future__ import annotations

import torch
from vllm.v1.kv_cache_interface import KVCacheConfig, UniformTypeKVCacheSpecs
from vllm.v1.worker.utils import create_kv_cache_views


def allocate_device_kv_cache(
    kv_cache_config: KVCacheConfig,
    device: torch.device,
    dtype: torch.dtype,
    layout: object,
    kernel_block_sizes: list[int] | None = None,
) -> dict[str, torch.Tensor]:
    """Per-layer KV cache views over one zeroed ``dtype`` buffer on ``device``."""
    if not kv_cache_config.kv_cache_tensors:
        return {}
    sizes = {tensor.size for tensor in kv_cache_config.kv_cache_tensors}
    if len(sizes) != 1:
        raise ValueError("KV cache tensors must share one backing allocation")
    raw_size = sizes.pop()
    itemsize = torch.empty((), dtype=dtype).element_size()
    if raw_size % itemsize:
        raise ValueError(f"KV cache size {raw_size} B is not a whole number of {dtype} elements")
    backing = torch.zeros(raw_size // itemsize, dtype=dtype, device=device)
    as_bytes = backing.view(torch.int8)  # a view for vLLM's byte offsets, no int8 data
    kv_caches: dict[str, torch.Tensor] = {}
    for tensor in kv_cache_config.kv_cache_tensors:
        layer_name = tensor.layers[0]
        group_id, group = next(
            (i, g)
            for i, g in enumerate(kv_cache_config.kv_cache_groups)
            if layer_name in g.layer_names
        )
        spec = group.kv_cache_spec
        if isinstance(spec, UniformTypeKVCacheSpecs):
            spec = spec.kv_cache_specs[layer_name]
        if not spec.has_layer_views:
            kv_caches.update((name, as_bytes) for name in tensor.layers)
            continue
        kernel_block_size = None
        if kernel_block_sizes is not None and group_id < len(kernel_block_sizes):
            kernel_block_size = kernel_block_sizes[group_id]
        views = create_kv_cache_views(
            as_bytes,
            spec,
            kv_cache_config.num_blocks_of(tensor),
            layout,
            tensor,
            kernel_block_size=kernel_block_size,
        )
        kv_caches.update(zip(tensor.layers, views, strict=True))
    return kv_caches
