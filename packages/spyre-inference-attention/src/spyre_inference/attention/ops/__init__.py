"""Attention kernels: the functions a compiled graph wraps.

Each kernel is a plain PyTorch function whose shapes are fixed by its inputs'
buckets (query bucket, KV block count), so a later stage can wrap it in
``torch.compile(dynamic=False)`` per bucket without changing it. They take
device tensors only and make no placement decisions: index tensors arrive
already built on the host and copied over by the backend.
"""

from spyre_inference.attention.ops.kv_layout import (
    allocate_pages,
    slot_major_view,
    token_major_pages,
)
from spyre_inference.attention.ops.kv_store import store_kv
from spyre_inference.attention.ops.page_attention import mask_value, page_attention

__all__ = [
    "allocate_pages",
    "mask_value",
    "page_attention",
    "slot_major_view",
    "store_kv",
    "token_major_pages",
]
