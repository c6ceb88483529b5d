"""The paged KV cache: how a layer's cache tensor is viewed, in both layouts.

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

The head-major backend asks for ``LBHNC`` instead: physically
``[block, kv_head, token, K|V]``, which is the logical view itself. Folding
(block, kv_head) gives ``[num_blocks * num_kv_heads, block_size, 2 * head]``,
whose dim 0 is where a page of one KV head is indexed (the spec's folded axis
at device dim 0), and folding the token axis too gives the row view the
per-head KV store scatters through.
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


def _layout_error(kv_cache: torch.Tensor, layout: str, backend: str) -> ValueError:
    return ValueError(
        f"the KV cache is not stored in the {layout} layout (strides "
        f"{tuple(kv_cache.stride())} for logical shape {tuple(kv_cache.shape)}); the "
        f"{backend} Spyre backend needs VLLM_KV_CACHE_LAYOUT={layout} (or leave it unset)"
    )


def head_major_pages(kv_cache: torch.Tensor) -> torch.Tensor:
    """``[num_blocks * num_kv_heads, block_size, 2 * head_size]`` view of an LBHNC cache."""
    if kv_cache.dim() != 4:
        raise ValueError(
            "expected vLLM's logical 4-D layer cache [blocks, kv_heads, block_size, K|V], "
            f"got shape {tuple(kv_cache.shape)}"
        )
    num_blocks, num_kv_heads, block_size, content = kv_cache.shape
    try:
        return kv_cache.view(num_blocks * num_kv_heads, block_size, content)
    except RuntimeError as exc:
        raise _layout_error(kv_cache, "LBHNC", "head-major") from exc


def head_major_rows(kv_cache: torch.Tensor) -> torch.Tensor:
    """``[num_blocks * num_kv_heads * block_size, 2 * head_size]`` view for the per-head store."""
    pages = head_major_pages(kv_cache)
    try:
        return pages.view(-1, pages.shape[-1])
    except RuntimeError as exc:
        raise _layout_error(kv_cache, "LBHNC", "head-major") from exc


def allocate_head_major_pages(
    num_blocks: int,
    block_size: int,
    num_kv_heads: int,
    head_size: int,
    dtype: torch.dtype,
    device: torch.device | str,
) -> torch.Tensor:
    """A zeroed layer cache with the strides vLLM's ``LBHNC`` allocation produces.

    The logical ``[num_blocks, num_kv_heads, block_size, 2 * head_size]`` view
    is the dense tensor itself: a page of one KV head is one contiguous run.
    """
    return torch.zeros(
        (num_blocks, num_kv_heads, block_size, 2 * head_size), dtype=dtype, device=device
    )
