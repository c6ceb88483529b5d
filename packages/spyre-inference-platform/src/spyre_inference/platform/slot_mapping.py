"""Pure-PyTorch replacement for vLLM's Triton slot-mapping kernel.

vLLM is built with ``VLLM_TARGET_DEVICE=empty`` here, so there is neither a
Triton backend nor ``vllm._C`` to compute, for every scheduled token, the
flat KV-cache slot it writes (``block_id * block_size + offset``). This runs
on the host on both targets: the block table is host bookkeeping (spec,
"Device Placement Strategy"), and only the resulting slot vector is copied to
the device by the attention backend.
"""

from __future__ import annotations

import torch


def compute_slot_mapping_kernel(
    num_tokens: int,
    max_num_tokens: int,
    query_start_loc_ptr: torch.Tensor,
    positions_ptr: torch.Tensor,
    block_table_ptr: torch.Tensor,
    block_table_stride: int,
    slot_mapping_ptr: torch.Tensor,
    KV_CACHE_BLOCK_SIZE: int,
    TOTAL_CP_WORLD_SIZE: int = 1,
    TOTAL_CP_RANK: int = 0,
    CP_KV_CACHE_INTERLEAVE_SIZE: int = 1,
    PAD_ID: int = -1,
    BLOCK_SIZE: int = 1024,
) -> None:
    """Same contract (and argument names) as ``ComputeSlotMappingKernel.kernel``.

    Argument names mirror the Triton kernel's so vLLM's override dispatcher
    forwards launch arguments by name.
    """
    if TOTAL_CP_WORLD_SIZE != 1:
        raise NotImplementedError("spyre-inference does not support context parallelism.")
    num_reqs = query_start_loc_ptr.shape[0] - 1
    qsl = query_start_loc_ptr.to(torch.int64)
    counts = qsl[1:] - qsl[:-1]
    # Request index of every scheduled token (tokens are packed per request).
    req_idx = torch.repeat_interleave(torch.arange(num_reqs, dtype=torch.int64), counts)
    pos = positions_ptr[:num_tokens].to(torch.int64)
    table = block_table_ptr.reshape(-1, block_table_stride)
    block_numbers = table[req_idx, pos // KV_CACHE_BLOCK_SIZE].to(torch.int64)
    slot_mapping_ptr[:num_tokens] = block_numbers * KV_CACHE_BLOCK_SIZE + pos % KV_CACHE_BLOCK_SIZE
    slot_mapping_ptr[num_tokens:max_num_tokens] = PAD_ID
