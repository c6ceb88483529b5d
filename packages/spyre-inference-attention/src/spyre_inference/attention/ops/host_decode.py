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
from spyre_inference.platform.native_build import (
    NativeKernelUnavailable,
    load_kernel,
    load_torch_extension,
)

logger = get_logger(__name__)

_SOURCE = Path(__file__).with_name("csrc") / "paged_decode.c"
#: The call's checks and the kernel call as a torch operator (C++, torch's headers).
_DISPATCH_SOURCE = Path(__file__).with_name("csrc") / "decode_dispatch.cpp"
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


#: Instruction sets ``csrc/paged_decode.c`` has builds for (chosen once per
#: process by ``native_build.select_isa``, ``SPYRE_CPU_ISA`` forces one): the
#: AVX-512 build widens each 16-bit K/V row once for all of a KV head's query
#: heads, 16 lanes at a time; the AVX2 build once per head, 8 at a time.
ISAS = ("avx512", "avx2")

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
    L, P = ctypes.c_long, ctypes.c_void_p
    fn.argtypes = [
        P,
        ctypes.c_int,
        L,
        L,  # q, its kind, row and head strides
        L,
        L,
        L,  # S, H, D
        P,
        ctypes.c_int,
        L,
        L,
        L,
        L,  # pages, kind, page/slot/head strides, KVH
        P,
        L,
        L,
        P,  # block_ids, NBK, BS, mask
        ctypes.c_float,
        ctypes.c_float,
        P,  # scale, skip_below, sinks (or NULL)
        P,
        ctypes.c_int,
        L,
        L,
        L,  # out, its kind, row and head strides, zero_rows
        P,
        P,
        L,
        L,
        L,
        L,
        P,
        L,  # k, v, their row and head strides, slots, kv_tokens
        ctypes.c_int,  # threads
    ]
    lib.spyre_isa = isa
    logger.info("cpu target: decode-attention kernel, %s build, loaded from %s", isa, lib._name)
    return lib


@functools.cache
def _native_call() -> Any:
    """The C++ operator that checks the arguments and calls the loaded kernel, or None.

    Each decoder layer makes this call once per step; from Python its checks and
    the ctypes call with 35 arguments cost more than the kernel itself at batch 1
    (see ``csrc/decode_dispatch.cpp``). Without a C++ toolchain the Python path
    in :func:`_run` does the same.
    """
    lib = _library_or_error()
    if isinstance(lib, str):
        return None
    try:
        load_torch_extension(_DISPATCH_SOURCE, python_module=False)
    except NativeKernelUnavailable as exc:
        logger.info("cpu target: decode-attention kernel called from Python (%s)", exc)
        return None
    native = torch.ops.spyre_inference_attention_native
    native.set_kernel(ctypes.cast(lib.spyre_paged_decode, ctypes.c_void_p).value)
    return native.store_and_decode.default


@functools.cache
def _skip_below() -> float:
    """Mask entries below this are masked keys: half the graph's mask value."""
    from spyre_inference.attention.ops.page_attention import mask_value

    return mask_value(torch.float32) / 2


def reset_for_tests() -> None:
    """Forget the loaded build (tests that force ``SPYRE_CPU_ISA`` load another)."""
    _library_or_error.cache_clear()
    _native_call.cache_clear()


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


def _check_pages(pages: torch.Tensor, head_size: int, what: str) -> None:
    if pages.shape[-1] != 2 * head_size or pages.stride(3) != 1:
        raise ValueError(
            f"{what}: pages {tuple(pages.shape)} (strides {pages.stride()}) are not "
            f"token-major K|V rows of 2 x {head_size}"
        )
    if pages.dtype not in _KINDS:
        raise ValueError(f"{what}: no kernel for {pages.dtype} pages")


def _check_rows(t: torch.Tensor, name: str, what: str) -> None:
    """``t`` is ``[rows, heads, head_size]`` with contiguous head vectors, of a kernel dtype."""
    if t.dim() != 3 or t.stride(2) != 1 or t.dtype not in _KINDS:
        raise ValueError(
            f"{what}: {name} {tuple(t.shape)} {t.dtype} (strides {t.stride()}) is not "
            "[rows, heads, head_size] with contiguous heads"
        )


def _run(
    what: str,
    q: torch.Tensor,
    pages: torch.Tensor,
    block_ids: torch.Tensor,
    mask: torch.Tensor,
    scale: float,
    out: torch.Tensor,
    zero_rows: int,
    sinks: torch.Tensor | None,
    store: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None,
) -> None:
    """Checks, then one kernel call: the optional store, attention, padding rows."""
    native = _native_call()
    if native is not None:
        key, value, slots = store if store is not None else (None, None, None)
        native(
            q,
            key,
            value,
            slots,
            pages,
            block_ids,
            mask,
            scale,
            _skip_below(),
            out,
            sinks,
            MAX_GROUP,
        )
        return
    lib = _library_or_error()
    if isinstance(lib, str):
        raise NativeKernelUnavailable(lib)
    num_seqs, num_heads, head_size = q.shape
    _check_pages(pages, head_size, what)
    _check_rows(q, "query", what)
    _check_rows(out, "output", what)
    _, block_size, num_kv_heads, _ = pages.shape
    kv_blocks = block_ids.shape[1]
    if block_ids.shape[0] != num_seqs or mask.shape != (num_seqs, kv_blocks * block_size):
        raise ValueError(
            f"{what}: {num_seqs} queries, block table {tuple(block_ids.shape)} and "
            f"mask {tuple(mask.shape)} disagree"
        )
    if out.shape[0] < num_seqs + zero_rows or out.shape[1:] != q.shape[1:]:
        raise ValueError(f"{what}: output {tuple(out.shape)} does not hold {tuple(q.shape)}")
    if num_heads % num_kv_heads or num_heads // num_kv_heads > MAX_GROUP:
        # The kernel keeps per-group statistics for at most MAX_GROUP heads.
        raise ValueError(f"{what}: {num_heads} query heads over {num_kv_heads} KV heads")
    sk = None if sinks is None else sinks.to(torch.float32).contiguous()
    if sk is not None and sk.numel() != num_heads:
        raise ValueError(f"{what}: {sk.numel()} sinks for {num_heads} heads")
    ids = block_ids.to(torch.int64).contiguous()
    m = mask.to(torch.float32).contiguous()
    k = v = slots = None
    kv_tokens = 0
    if store is not None:
        k, v, slots = store
        for name, t in (("key", k), ("value", v)):
            _check_rows(t, name, what)
            if t.dtype != pages.dtype or t.shape[1:] != (num_kv_heads, head_size):
                raise ValueError(
                    f"{what}: {name} {tuple(t.shape)} {t.dtype} does not fit pages of "
                    f"{num_kv_heads} x {head_size} {pages.dtype}"
                )
        kv_tokens = k.shape[0]
        if v.shape[0] != kv_tokens or slots.shape != (kv_tokens,) or slots.dtype != torch.int64:
            raise ValueError(f"{what}: {kv_tokens} keys, {v.shape[0]} values, slots {slots.shape}")
        slots = slots.contiguous()
    failed = lib.spyre_paged_decode(
        q.data_ptr(),
        _KINDS[q.dtype],
        q.stride(0),
        q.stride(1),
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
        _skip_below(),
        None if sk is None else sk.data_ptr(),
        out.data_ptr(),
        _KINDS[out.dtype],
        out.stride(0),
        out.stride(1),
        zero_rows,
        None if k is None else k.data_ptr(),
        None if v is None else v.data_ptr(),
        0 if k is None else k.stride(0),
        0 if k is None else k.stride(1),
        0 if v is None else v.stride(0),
        0 if v is None else v.stride(1),
        None if slots is None else slots.data_ptr(),
        kv_tokens,
        torch.get_num_threads(),
    )
    if failed:
        raise MemoryError(f"{what}: no memory for {kv_blocks * block_size} scores")


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
        q: ``[num_seqs, num_heads, head_size]``, float32, bfloat16 or float16.
        pages: ``[num_blocks, block_size, num_kv_heads, 2 * head_size]``
            token-major pages (K|V per slot), last dim contiguous.
        block_ids: ``[num_seqs, kv_blocks]`` int64 page ids per sequence.
        mask: ``[num_seqs, kv_blocks * block_size]`` additive mask; entries
            below half of :func:`~.page_attention.mask_value` are masked keys.
        sinks: ``[num_heads]`` attention-sink logits, or None (see
            :func:`~.page_attention.online_softmax`).

    Returns:
        ``[num_seqs, num_heads, head_size]``, computed in float32 and returned
        in ``out_dtype`` (rounded inside the kernel's range: the card's graph
        returns the query's dtype too); a sequence without any unmasked key (a
        padding entry) gets zeros.
    """
    global _calls
    _calls += 1
    out = torch.empty(q.shape, dtype=out_dtype)
    with as_graph_call("paged decode attention"):
        _run("paged_decode", q, pages, block_ids, mask, scale, out, 0, sinks, None)
    return out


def store_and_decode(
    q: torch.Tensor,
    key: torch.Tensor | None,
    value: torch.Tensor | None,
    slots: torch.Tensor | None,
    pages: torch.Tensor,
    block_ids: torch.Tensor,
    mask: torch.Tensor,
    scale: float,
    output: torch.Tensor,
    sinks: torch.Tensor | None = None,
) -> None:
    """A layer's whole attention step on the cpu target, in one kernel call.

    Stores ``key``/``value`` (``[num_tokens, num_kv_heads, head_size]``, the
    cache's dtype, any row stride: views into the fused QKV output are read
    where they lie) at ``slots`` (``[num_tokens]`` int64; padding tokens at a
    null-block slot), then writes :func:`paged_decode` of the ``q.shape[0]``
    rows of ``q`` into the first rows of ``output`` (its dtype, any row stride)
    and zeros the rest of ``output``'s rows (the step's padding). What the
    card runs as two compiled graphs (the KV store, then attention) and the
    copy of the result into the output, as one call: one profiler range, and
    no Python between the store and the attention.
    """
    global _calls
    _calls += 1
    with as_graph_call("KV store + paged decode attention"):
        _run(
            "store_and_decode",
            q,
            pages,
            block_ids,
            mask,
            scale,
            output,
            output.shape[0] - q.shape[0],
            sinks,
            None if key is None or value is None or slots is None else (key, value, slots),
        )


__all__ = [
    "MAX_GROUP",
    "PROFILER_RANGE",
    "as_graph_call",
    "calls",
    "paged_decode",
    "reset_for_tests",
    "store_and_decode",
    "unavailable_reason",
]
