"""The token-major paged KV cache: how a layer's cache tensor is viewed.

vLLM 0.33 hands every attention layer its cache as a *logical* 4-D view
``[num_blocks, num_kv_heads, block_size, head_size + head_size_v]`` (K in the
first ``head_size`` elements of the last axis, V in the rest), whose strides
follow the resolved :class:`~vllm.v1.kv_cache_layout.KVCacheLayout`. The
token-major backend asks for ``LBNHC``: each layer owns one dense region
(layer outermost) laid out physically as ``[block, token, kv_head, K|V]``. So:

* ``kv_cache.transpose(1, 2)`` is the dense token-major page tensor
  ``[num_blocks, block_size, num_kv_heads, 2 * head_size]``: a page is read by
  indexing dim 0, and the K and V of one page are its two halves of the last
  axis, ``[block_size, num_kv_heads, head_size]`` each;
* folding (block, token) gives the slot-major view
  ``[num_blocks * block_size, num_kv_heads, 2 * head_size]``, through which
  the KV store scatters one contiguous run (a token's K and V for every KV
  head) per new token with a single ``index_copy_``.

Both are views (no copy), which holds only because the layout is
layer-compact and token-major; any other layout is rejected loudly rather
than silently writing into a temporary.
"""

from __future__ import annotations

import torch


def token_major_pages(kv_cache: torch.Tensor) -> torch.Tensor:
    """``[num_blocks, block_size, num_kv_heads, 2 * head_size]`` view of a layer cache."""
    if kv_cache.dim() != 4:
        raise ValueError(
            "expected vLLM's logical 4-D layer cache [blocks, kv_heads, block_size, K|V], "
            f"got shape {tuple(kv_cache.shape)}"
        )
    return kv_cache.transpose(1, 2)


def slot_major_view(kv_cache: torch.Tensor) -> torch.Tensor:
    """``[num_blocks * block_size, num_kv_heads, 2 * head_size]`` view for the scatter.

    Raises if the cache is not stored token-major and layer-compact (the
    ``LBNHC`` layout), because then no single slot axis exists and a
    ``reshape`` would scatter into a copy that is thrown away.
    """
    pages = token_major_pages(kv_cache)
    num_blocks, block_size, num_kv_heads, content = pages.shape
    try:
        return pages.view(num_blocks * block_size, num_kv_heads, content)
    except RuntimeError as exc:
        raise ValueError(
            "the KV cache is not stored token-major and layer-compact (strides "
            f"{tuple(kv_cache.stride())} for logical shape {tuple(kv_cache.shape)}); the "
            "token-major Spyre backend needs the LBNHC KV-cache layout "
            "(VLLM_KV_CACHE_LAYOUT=LBNHC or leave it unset)"
        ) from exc


def allocate_pages(
    num_blocks: int,
    block_size: int,
    num_kv_heads: int,
    head_size: int,
    dtype: torch.dtype,
    device: torch.device | str,
) -> torch.Tensor:
    """A zeroed layer cache with the strides vLLM's ``LBNHC`` allocation produces.

    Returned as the logical ``[num_blocks, num_kv_heads, block_size, 2 * head_size]``
    view that the impl receives, backed by one dense token-major tensor. For a
    runner that allocates per layer on the device itself instead of through
    vLLM's flat int8 buffer.
    """
    dense = torch.zeros(
        (num_blocks, block_size, num_kv_heads, 2 * head_size), dtype=dtype, device=device
    )
    return dense.transpose(1, 2)
