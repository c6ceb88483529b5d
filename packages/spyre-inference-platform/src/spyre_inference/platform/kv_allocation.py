"""The KV cache's backing memory, on the card and on the host.

vLLM (``vllm.v1.worker.utils.allocate_kv_cache``) backs every layer's cache
with one flat ``int8`` buffer from ``torch.zeros`` and takes per-layer views of
it (:func:`create_kv_cache_views`). The runner keeps those views, layouts,
strides and cross-group overlays exactly vLLM's, and changes only where the
bytes come from:

* **card**: the cache must live on the device, which has no ``int8`` tensors,
  so the buffer is allocated there in the cache's float dtype and
  reinterpreted as bytes only to take the views (:func:`device_backing`);
* **cpu target**: ``torch.zeros`` writes every byte before serving starts.
  With ``LLM()`` defaults the cache is most of the host's memory (13.8 GiB for
  SmolLM2 at 8192 tokens on a 24 GB host) and zeroing it took 17.5 s of a 64 s
  start-up on a 2-core EPYC, one page fault after another. Anonymous ``mmap``
  memory is zero by the kernel's guarantee and is faulted in as blocks are
  first written (:func:`zeroed_host_backing`): the same zeros, paid per block
  while serving instead of all up front.
"""

from __future__ import annotations

import mmap

import torch
from vllm.v1.kv_cache_interface import KVCacheConfig, UniformTypeKVCacheSpecs
from vllm.v1.worker.utils import create_kv_cache_views


def backing_size(kv_cache_config: KVCacheConfig) -> int:
    """Bytes of the one allocation every KV cache tensor shares (0: no cache)."""
    if not kv_cache_config.kv_cache_tensors:
        return 0
    sizes = {tensor.size for tensor in kv_cache_config.kv_cache_tensors}
    if len(sizes) != 1:
        raise ValueError("KV cache tensors must share one backing allocation")
    return sizes.pop()


def device_backing(nbytes: int, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """``nbytes`` of zeros on ``device`` in ``dtype``, viewed as ``int8`` bytes."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    if nbytes % itemsize:
        raise ValueError(f"KV cache size {nbytes} B is not a whole number of {dtype} elements")
    backing = torch.zeros(nbytes // itemsize, dtype=dtype, device=device)
    return backing.view(torch.int8)  # a view for vLLM's byte offsets, no int8 data


def zeroed_host_backing(nbytes: int) -> torch.Tensor:
    """``nbytes`` of host zeros as ``int8``, backed by anonymous ``mmap`` pages.

    The tensor holds the mapping (``torch.frombuffer`` keeps its buffer alive);
    pages are zero-filled by the kernel on first touch, so the faults move from
    start-up to the first write of each page. No transparent huge pages are
    requested (``MADV_HUGEPAGE``): with the common ``defrag=madvise`` setting each
    first touch of a 2 MiB page then compacts memory synchronously. Measured on a
    2-core Zen 4 VM (24 GB): the first writes of a 500-token prompt's K|V into 30
    layers' fresh pages took 161 ms with the hint and 3.8 ms without, and vLLM's
    free-block queue hands out untouched blocks until the whole cache has been
    used once, so every early request paid it.
    """
    if nbytes == 0:
        return torch.zeros(0, dtype=torch.int8)
    mapping = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    return torch.frombuffer(mapping, dtype=torch.int8)


def kv_cache_views(
    kv_cache_config: KVCacheConfig,
    backing: torch.Tensor,
    layout: object,
    kernel_block_sizes: list[int] | None = None,
) -> dict[str, torch.Tensor]:
    """vLLM's per-layer KV cache views over ``backing`` (``int8`` bytes)."""
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
            kv_caches.update((name, backing) for name in tensor.layers)
            continue
        kernel_block_size = None
        if kernel_block_sizes is not None and group_id < len(kernel_block_sizes):
            kernel_block_size = kernel_block_sizes[group_id]
        views = create_kv_cache_views(
            backing,
            spec,
            kv_cache_config.num_blocks_of(tensor),
            layout,
            tensor,
            kernel_block_size=kernel_block_size,
        )
        kv_caches.update(zip(tensor.layers, views, strict=True))
    return kv_caches
