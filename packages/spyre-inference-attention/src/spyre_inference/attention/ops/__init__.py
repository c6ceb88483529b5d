"""Attention kernels: the functions the compiled graphs wrap.

Each kernel is a plain PyTorch function whose shapes are fixed by its inputs'
buckets, wrapped in a :class:`~spyre_inference.attention.ops.compiled.KernelFamily`
that compiles it once per bucket with ``torch.compile(dynamic=False)`` (or runs
it eagerly). They take device tensors only and make no placement decisions:
index tensors arrive already built on the host and copied over by the
backend.
"""

from spyre_inference.attention.ops import host_decode, host_prefill
from spyre_inference.attention.ops.compiled import KernelFamily, spyre_core_cap
from spyre_inference.attention.ops.encoder_attention import (
    encoder_fused,
    encoder_probs_v,
    encoder_scores,
)
from spyre_inference.attention.ops.kv_layout import (
    allocate_head_major_pages,
    allocate_pages,
    head_major_pages,
    head_major_rows,
    slot_major_view,
    token_major_pages,
)
from spyre_inference.attention.ops.kv_store import kv_source, store_kv, store_kv_head_major
from spyre_inference.attention.ops.page_attention import (
    batched_decode_attention,
    head_major_page_attention,
    mask_value,
    online_softmax,
    page_attention,
)

#: One family per kernel, shared by every layer and backend of the process.
PAGE_ATTENTION = KernelFamily(page_attention)
BATCHED_DECODE = KernelFamily(batched_decode_attention)
STORE_KV = KernelFamily(store_kv)
ENCODER_SCORES = KernelFamily(encoder_scores)
ENCODER_PROBS_V = KernelFamily(encoder_probs_v)
ENCODER_FUSED = KernelFamily(encoder_fused)
#: The head-major kernels compile under the core cap (spec, "LX-resident pages").
HEAD_MAJOR_ATTENTION = KernelFamily(head_major_page_attention, compile_context=spyre_core_cap)
STORE_KV_HEAD_MAJOR = KernelFamily(store_kv_head_major, compile_context=spyre_core_cap)

__all__ = [
    "BATCHED_DECODE",
    "ENCODER_FUSED",
    "ENCODER_PROBS_V",
    "ENCODER_SCORES",
    "HEAD_MAJOR_ATTENTION",
    "PAGE_ATTENTION",
    "STORE_KV",
    "STORE_KV_HEAD_MAJOR",
    "KernelFamily",
    "allocate_head_major_pages",
    "allocate_pages",
    "batched_decode_attention",
    "encoder_fused",
    "encoder_probs_v",
    "encoder_scores",
    "head_major_page_attention",
    "head_major_pages",
    "head_major_rows",
    "host_decode",
    "host_prefill",
    "kv_source",
    "mask_value",
    "online_softmax",
    "page_attention",
    "slot_major_view",
    "store_kv",
    "store_kv_head_major",
    "token_major_pages",
]
