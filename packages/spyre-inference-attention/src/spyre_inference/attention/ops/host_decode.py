"""The cpu target's decode attention: one C kernel over the paged KV cache.

On the card a decode batch runs as one compiled graph per (num-seqs, pages)
bucket (:func:`~spyre_inference.attention.ops.page_attention.batched_decode_attention`).
On a CPU the same graph gathers whole pages into a new tensor, widens them to
float32 and runs PyTorch's flash kernel: 300-800 us per layer for one to four
sequences on a 2-core Zen 1 host, nearly all of it fixed cost, where the bytes
to read are ~100 KB per page. ``csrc/paged_decode.c`` instead reads each K|V
row where it lies, through the block table, and computes in float32 what the
graph computes (float32 scores, softmax and sum of float32-widened values): about
10 us per layer at batch 1 and 0.3 ms at 32 sequences of ~160 keys, with the
KV cache cold as in a real step (see ``benchmarks/sxs/analysis/amd-avx2.md``).

It keeps the graph's interface (the same bucketed block table and additive
mask the metadata builder makes for the card), so only the kernel differs
between the targets. Built and loaded like the ops package's host GEMM
(:mod:`spyre_inference.platform.native_build`). Not for soft-capped or ALiBi
layers, which keep the graph.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
from pathlib import Path
from typing import Any

import torch

from spyre_inference.platform.logs import get_logger
from spyre_inference.platform.native_build import NativeKernelUnavailable, load_kernel

logger = get_logger(__name__)

_SOURCE = Path(__file__).with_name("csrc") / "paged_decode.c"
#: Cache dtype -> the kernel's element kind.
_KINDS = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
#: Most query heads per KV head the kernel keeps statistics for.
MAX_GROUP = 64
#: Profiler ranges of the cpu target's host paths that stand in for one
#: compiled graph of the card start with this; the benchmark's Spyre cost
#: proxies count each range as one graph call.
PROFILER_RANGE = "## Spyre host kernel"


def as_graph_call(what: str) -> contextlib.AbstractContextManager[Any]:
    """A profiler range marking host work the card runs as one compiled graph.

    Only entered while a profiler runs: a range costs tens of microseconds,
    more than the KV store it would wrap.
    """
    if torch.autograd.profiler._is_profiler_enabled:
        return torch.profiler.record_function(f"{PROFILER_RANGE}: {what}")
    return contextlib.nullcontext()


#: Instruction sets ``csrc/paged_decode.c`` has builds for.
ISAS = ("avx2",)

_calls = 0


def calls() -> int:
    """Kernel calls in this process (evidence for tests that it, not the graph, ran)."""
    return _calls


@functools.cache
def _library_or_error() -> ctypes.CDLL | str:
    """The loaded kernel, or why it cannot be had (tried once per process)."""
    try:
        lib, isa = load_kernel(_SOURCE, ISAS)
    except (NativeKernelUnavailable, OSError) as exc:
        logger.info("cpu target: decode-attention kernel unavailable (%s); using the graph", exc)
        return str(exc)
    fn = lib.spyre_paged_decode
    fn.restype = ctypes.c_int
    fn.argtypes = [
        ctypes.c_void_p,  # q
        ctypes.c_long,  # S
        ctypes.c_long,  # H
        ctypes.c_long,  # D
        ctypes.c_void_p,  # pages
        ctypes.c_int,  # kind
        ctypes.c_long,  # page stride
        ctypes.c_long,  # slot stride
        ctypes.c_long,  # head stride
        ctypes.c_long,  # KVH
        ctypes.c_void_p,  # block_ids
        ctypes.c_long,  # NBK
        ctypes.c_long,  # BS
        ctypes.c_void_p,  # mask
        ctypes.c_float,  # scale
        ctypes.c_float,  # skip_below
        ctypes.c_void_p,  # sinks (or NULL)
        ctypes.c_void_p,  # out
        ctypes.c_int,  # threads
    ]
    lib.spyre_isa = isa
    logger.info("cpu target: decode-attention kernel, %s build, loaded from %s", isa, lib._name)
    return lib


def kernel_isa() -> str | None:
    """The instruction set of the loaded kernel build, or None when it is unavailable."""
    lib = _library_or_error()
    return None if isinstance(lib, str) else lib.spyre_isa


def unavailable_reason(
    cache_dtype: torch.dtype, head_size: int, num_heads: int, num_kv_heads: int
) -> str | None:
    """None when :func:`paged_decode` serves this layer shape, else why not."""
    if cache_dtype not in _KINDS:
        return f"KV cache dtype {cache_dtype}"
    if head_size % 8:
        return f"head size {head_size} is not a multiple of 8"
    if num_heads % num_kv_heads or num_heads // num_kv_heads > MAX_GROUP:
        return f"{num_heads} query heads over {num_kv_heads} KV heads"
    lib = _library_or_error()
    return lib if isinstance(lib, str) else None


def paged_decode(
    q: torch.Tensor,
    pages: torch.Tensor,
    block_ids: torch.Tensor,
    mask: torch.Tensor,
    scale: float,
    out_dtype: torch.dtype = torch.float32,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """``softmax(q k^T * scale + mask) v`` of one query row per sequence.

    Args:
        q: ``[num_seqs, num_heads, head_size]``.
        pages: ``[num_blocks, block_size, num_kv_heads, 2 * head_size]``
            token-major pages (K|V per slot), last dim contiguous.
        block_ids: ``[num_seqs, kv_blocks]`` int64 page ids per sequence.
        mask: ``[num_seqs, kv_blocks * block_size]`` additive mask; entries
            below half of :func:`~.page_attention.mask_value` are masked keys.
        sinks: ``[num_heads]`` attention-sink logits, or None (see
            :func:`~.page_attention.online_softmax`).

    Returns:
        ``[num_seqs, num_heads, head_size]``, computed in float32 and returned
        in ``out_dtype`` (converted inside the kernel's range: the card's graph
        returns the query's dtype too); a sequence without any unmasked key (a
        padding entry) gets zeros.
    """
    from spyre_inference.attention.ops.page_attention import mask_value

    lib = _library_or_error()
    if isinstance(lib, str):
        raise NativeKernelUnavailable(lib)
    num_seqs, num_heads, head_size = q.shape
    _, block_size, num_kv_heads, content = pages.shape
    if content != 2 * head_size or pages.stride(3) != 1:
        raise ValueError(
            f"paged_decode: pages {tuple(pages.shape)} (strides {pages.stride()}) are not "
            f"token-major K|V rows of 2 x {head_size}"
        )
    if pages.dtype not in _KINDS:
        raise ValueError(f"paged_decode: no kernel for {pages.dtype} pages")
    kv_blocks = block_ids.shape[1]
    if block_ids.shape[0] != num_seqs or mask.shape != (num_seqs, kv_blocks * block_size):
        raise ValueError(
            f"paged_decode: {num_seqs} queries, block table {tuple(block_ids.shape)} and "
            f"mask {tuple(mask.shape)} disagree"
        )
    if num_heads % num_kv_heads or num_heads // num_kv_heads > MAX_GROUP:
        # The kernel keeps per-group statistics for at most MAX_GROUP heads.
        raise ValueError(f"paged_decode: {num_heads} query heads over {num_kv_heads} KV heads")
    global _calls
    _calls += 1
    with as_graph_call("paged decode attention"):
        qf = q.to(torch.float32).contiguous()
        ids = block_ids.to(torch.int64).contiguous()
        m = mask.to(torch.float32).contiguous()
        sk = None if sinks is None else sinks.to(torch.float32).contiguous()
        if sk is not None and sk.numel() != num_heads:
            raise ValueError(f"paged_decode: {sk.numel()} sinks for {num_heads} heads")
        out = torch.empty((num_seqs, num_heads, head_size), dtype=torch.float32)
        failed = lib.spyre_paged_decode(
            qf.data_ptr(),
            num_seqs,
            num_heads,
            head_size,
            pages.data_ptr(),
            _KINDS[pages.dtype],
            pages.stride(0),
            pages.stride(1),
            pages.stride(2),
            num_kv_heads,
            ids.data_ptr(),
            kv_blocks,
            block_size,
            m.data_ptr(),
            scale,
            mask_value(torch.float32) / 2,
            None if sk is None else sk.data_ptr(),
            out.data_ptr(),
            torch.get_num_threads(),
        )
        if not failed and out_dtype != torch.float32:
            out = out.to(out_dtype)
    if failed:
        raise MemoryError(f"paged_decode: no memory for {kv_blocks * block_size} scores")
    return out


__all__ = [
    "MAX_GROUP",
    "PROFILER_RANGE",
    "as_graph_call",
    "calls",
    "paged_decode",
    "unavailable_reason",
]
