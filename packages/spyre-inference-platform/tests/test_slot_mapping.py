"""The pure-PyTorch slot mapping agrees with the definition, through vLLM's own dispatcher."""

from __future__ import annotations

import random

import torch

from spyre_inference.platform.slot_mapping import compute_slot_mapping_kernel


def _reference(query_start_loc, positions, block_table, block_size):
    slots = []
    for req in range(len(query_start_loc) - 1):
        for tok in range(query_start_loc[req], query_start_loc[req + 1]):
            pos = positions[tok]
            slots.append(block_table[req][pos // block_size] * block_size + pos % block_size)
    return slots


def test_matches_definition_with_padding() -> None:
    rng = random.Random(0)
    block_size, max_blocks, max_tokens = 64, 8, 300
    for _ in range(20):
        num_reqs = rng.randint(1, 6)
        counts = [rng.randint(1, 40) for _ in range(num_reqs)]
        starts = [rng.randint(0, max_blocks * block_size - c) for c in counts]
        qsl = [0]
        positions = []
        for c, s in zip(counts, starts, strict=True):
            qsl.append(qsl[-1] + c)
            positions.extend(range(s, s + c))
        table = [[rng.randint(1, 500) for _ in range(max_blocks)] for _ in range(num_reqs + 2)]
        out = torch.full((max_tokens,), 12345, dtype=torch.int64)
        compute_slot_mapping_kernel(
            num_tokens=len(positions),
            max_num_tokens=max_tokens,
            query_start_loc_ptr=torch.tensor(qsl, dtype=torch.int32),
            positions_ptr=torch.tensor(positions, dtype=torch.int64),
            block_table_ptr=torch.tensor(table, dtype=torch.int32),
            block_table_stride=max_blocks,
            slot_mapping_ptr=out,
            KV_CACHE_BLOCK_SIZE=block_size,
            PAD_ID=-1,
        )
        n = len(positions)
        assert out[:n].tolist() == _reference(qsl, positions, table, block_size)
        assert (out[n:] == -1).all()


def test_registered_through_vllm_dispatcher() -> None:
    """vLLM's block table calls the kernel through its override registry."""
    from vllm.v1.worker import block_table as bt

    from spyre_inference.platform.platform import TorchSpyrePlatform

    TorchSpyrePlatform.register_triton_kernel_overrides()
    table = torch.tensor([[3, 7, 0, 0], [5, 0, 0, 0]], dtype=torch.int32)
    out = torch.zeros(8, dtype=torch.int64)
    bt._COMPUTE_SLOT_MAPPING_KERNEL(
        num_reqs=2,
        num_tokens=3,
        max_num_tokens=8,
        query_start_loc=torch.tensor([0, 2, 3], dtype=torch.int32),
        positions=torch.tensor([63, 64, 1], dtype=torch.int64),
        block_table=table,
        block_table_stride=4,
        slot_mapping=out,
        kv_cache_block_size=64,
        total_cp_world_size=1,
        total_cp_rank=0,
        cp_kv_cache_interleave_size=1,
    )
    assert out[:3].tolist() == [3 * 64 + 63, 7 * 64 + 0, 5 * 64 + 1]
    assert (out[3:] == -1).all()
