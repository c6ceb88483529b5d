"""Compiled attention kernels: one Inductor graph per shape variant.

Every attention kernel is compiled with ``dynamic=False`` (torch-spyre's
Inductor backend rejects SymInt shapes), so each bucket pair is its own graph.
A :class:`KernelFamily` wraps one kernel function and keeps those graphs apart:

* **One Dynamo entry per variant.** Each variant gets its own copy of the
  kernel's code object before ``torch.compile``. Dynamo keeps its cache (and
  its recompile limit) per code object, so a variant's call checks the guards
  of exactly one entry instead of walking a list that grows with the number of
  buckets, and no limit silently turns a late variant eager.
* **The variant key mirrors Dynamo's guards**: shape, stride and dtype of
  every tensor argument plus the value of every other argument (scale,
  soft-cap, tile sizes). A key seen before is a dictionary hit; a new key is a
  new graph, compiled on its first call (lazy, ``SPYRE_ATTN_RECORD=0``) or by
  warm-up recording every variant up front (the default).
* **Eager fallback.** A family can run its function eagerly (the token-major
  backend under ``--enforce-eager``); the same code then runs without Dynamo.

Compiles after warm-up are counted (:data:`stats`) and logged once per
variant, so a serving path that misses a bucket is visible.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
import time
import types
from collections.abc import Callable, Iterator
from typing import Any

import torch

from spyre_inference.platform.block_compile import compile_kwargs
from spyre_inference.platform.logs import get_logger

logger = get_logger(__name__)


@dataclasses.dataclass
class CompileStats:
    """Process-wide counts of attention graphs (all families)."""

    #: graphs compiled while recording (warm-up)
    recorded: int = 0
    #: graphs compiled on first use outside warm-up
    lazy: int = 0
    #: seconds spent in first calls (compile + one run)
    compile_seconds: float = 0.0

    @property
    def total(self) -> int:
        return self.recorded + self.lazy


stats = CompileStats()
_state = threading.local()
#: Set once a warm-up has recorded the variants: a compile after that is a
#: bucket warm-up missed, worth a warning (in lazy mode it is the plan).
_warm_up_recorded = False


def mark_recorded() -> None:
    """Warm-up recorded every variant; later compiles are misses."""
    global _warm_up_recorded
    _warm_up_recorded = True


@contextlib.contextmanager
def recording() -> Iterator[None]:
    """Mark compiles inside this block as warm-up recording (not lazy)."""
    previous = getattr(_state, "recording", False)
    _state.recording = True
    try:
        yield
    finally:
        _state.recording = previous


def is_recording() -> bool:
    return getattr(_state, "recording", False)


def _signature(arg: Any) -> Any:
    if isinstance(arg, torch.Tensor):
        return (tuple(arg.shape), arg.stride(), arg.dtype, arg.device.type)
    if isinstance(arg, (list, tuple)):
        return tuple(_signature(a) for a in arg)
    return arg


def _fresh_copy(fn: Callable[..., Any], tag: str) -> Callable[..., Any]:
    """``fn`` with its own code object, so Dynamo caches it separately."""
    code = fn.__code__.replace(co_name=f"{fn.__name__}__{tag}")
    copy = types.FunctionType(code, fn.__globals__, code.co_name, fn.__defaults__, fn.__closure__)
    copy.__kwdefaults__ = fn.__kwdefaults__
    copy.__qualname__ = f"{fn.__qualname__}__{tag}"
    return copy


class KernelFamily:
    """The compiled variants of one kernel function.

    Args:
        fn: the kernel, a plain PyTorch function of tensors and static values.
        name: for logs.
        compile_context: entered around the first call of each variant (the
            compile); the head-major backend caps its cores there.
    """

    def __init__(
        self,
        fn: Callable[..., Any],
        name: str | None = None,
        compile_context: Callable[[], contextlib.AbstractContextManager[Any]] | None = None,
    ) -> None:
        self.fn = fn
        self.name = name or fn.__name__
        self.compile_context = compile_context or contextlib.nullcontext
        self._variants: dict[Any, Callable[..., Any]] = {}
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._variants)

    def keys(self) -> list[Any]:
        return list(self._variants)

    def __call__(self, compiled: bool, *args: Any) -> Any:
        """Run the kernel on ``args``: through its compiled variant, or eagerly."""
        if not compiled:
            return self.fn(*args)
        key = _signature(args)
        variant = self._variants.get(key)
        # One dispatch state for every call, because Dynamo guards on it and it
        # differs by caller: attention and the KV store run inside the runtime
        # of a compiled block graph when the model compiles (torch-function
        # subclasses off, ADInplaceOrView excluded), outside any graph under
        # --enforce-eager, and from Python in warm-up. Without this, a variant
        # recorded in warm-up would recompile on its first served step. The
        # kernels are inference-only and use no tensor subclass or function
        # mode, so neither switch changes what they compute.
        with torch._C.DisableTorchFunction(), torch._C._AutoDispatchBelowADInplaceOrView():
            if variant is not None:
                return variant(*args)
            return self._first_call(key, args)

    def _first_call(self, key: Any, args: tuple[Any, ...]) -> Any:
        with self._lock:
            variant = self._variants.get(key)
            if variant is None:
                tag = str(len(self._variants))
                variant = torch.compile(_fresh_copy(self.fn, tag), **compile_kwargs())
                self._variants[key] = variant
        recorded = is_recording()
        if not recorded and _warm_up_recorded:
            logger.warning(
                "Attention kernel %s: compiling a variant outside warm-up (%s). Enable "
                "SPYRE_ATTN_RECORD=1 (the default) so warm-up records it, or report the "
                "shape if it is already on.",
                self.name,
                _describe(key),
            )
        start = time.perf_counter()
        # Full guard stance for the compile: a served step may run under the
        # platform's settled guards (skip_guard_eval_unsafe), where Dynamo
        # refuses to compile anything. Later calls of this variant may skip
        # guards safely: its code object holds exactly this one graph, chosen
        # by a key that mirrors the guards.
        with self.compile_context(), torch.compiler.set_stance("default"):
            out = variant(*args)
        elapsed = time.perf_counter() - start
        stats.compile_seconds += elapsed
        if recorded:
            stats.recorded += 1
        else:
            stats.lazy += 1
        logger.debug("Attention kernel %s variant %s ready in %.1f s", self.name, key, elapsed)
        return out


def _describe(key: Any) -> str:
    parts = []
    for item in key:
        if isinstance(item, tuple) and len(item) == 4 and isinstance(item[2], torch.dtype):
            parts.append("x".join(map(str, item[0])) or "scalar")
        else:
            parts.append(repr(item))
    return ", ".join(parts)


def spyre_core_cap() -> contextlib.AbstractContextManager[Any]:
    """Cap the cores of an attention compile on the card (``SPYRE_ATTN_MAX_CORES``).

    Spec ("LX-resident pages"): the head-major kernel's output axes
    (``num_kv_heads * padded_query_len``) cannot fill 32 cores at decode, and
    filling them would mean K-splitting a reduction the page gather cannot
    mirror, so its compile alone runs on at most 8 cores by default. The
    setting is torch-spyre's work-division core count (``sencores``). The cpu
    target has no such knob; nothing changes there.
    """
    from spyre_inference.platform import device as placement
    from spyre_inference.platform import settings

    if not placement.has_card():
        return contextlib.nullcontext()
    cores = settings.get("SPYRE_ATTN_MAX_CORES")
    try:
        from torch_spyre._inductor import config as spyre_config  # type: ignore[import-not-found]

        return spyre_config.patch(sencores=cores)
    except (ImportError, AttributeError) as exc:
        logger.warning(
            "Cannot cap the attention compile at %d cores (torch-spyre has no "
            "_inductor.config.sencores: %s); compiling with the default core count.",
            cores,
            exc,
        )
        return contextlib.nullcontext()
