"""Settled blocks called straight into their compiled code, past Dynamo's frame evaluation.

Why: a compiled block reached through ``torch.compile``'s wrapper pays, per
call, the wrapper's own work (eval-frame callback, dispatch-key and config
guards, hooks), Dynamo's cache lookup and the interpreter frame it sets up
before the transformed bytecode reaches the graph. Measured on the 2-core
hosts: about 100 us per block call, 2.9 ms of a 21 ms batch-1 SmolLM2 decode
step (30 blocks), while the graphs themselves are unchanged. The card pays
the same host cost per block (torch-spyre compiles through Dynamo as well).

How: Dynamo keeps, on the ``forward`` code object that blocks of one class
share, one cache entry per graph: its guards and its transformed bytecode
(which fetches the block's parameters and calls the compiled graph). vLLM's
own ``TorchCompileWithNoGuardsWrapper`` (``vllm/compilation/wrapper.py``)
runs that bytecode as a plain function once compiled; this does the same per
block and *call signature*: the arguments' tensor shapes, strides, dtypes and
devices, the other arguments' values, and the grad and inference modes. The
first call of a signature evaluates every cache entry's full guards on the
actual arguments and keeps the one entry that passes; later calls of that
signature run its bytecode directly.

When: only inside :func:`direct_calls`, which
:class:`~spyre_inference.platform.model_wrapper.SettledGuards` enters for a
*settled* num_tokens bucket (warm-up compiled it and its first served step
added no graph): the same condition under which it already skips all but the
differentiating guards. A signature that no entry, or more than one, passes,
arguments it cannot key (a list, an object), and blocks with forward hooks
stay on the ordinary compiled call.

Installing replaces the callable that ``nn.Module.compile`` stores in the
block's ``_compiled_call_impl`` (torch's documented ``Module.compile`` keeps
no other handle) with a dispatcher holding the original; nothing else of the
block changes, so its parameters, names and state dict stay as they were.
"""

from __future__ import annotations

import contextlib
import inspect
import types
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn
from torch.nn.modules import module as nn_module

from spyre_inference.platform.logs import get_logger

logger = get_logger(__name__)

__all__ = ["DirectCallStats", "cache_entries", "direct_calls", "install", "stats"]

#: An argument the call signature cannot hold (unhashable, or an object whose
#: attributes Dynamo may guard on): such calls keep the ordinary compiled path.
_UNKEYABLE = object()


class DirectCallStats:
    """Counts for tests and diagnostics (process-wide)."""

    def __init__(self) -> None:
        self.direct = 0
        self.resolved = 0
        self.refused = 0

    def snapshot(self) -> dict[str, int]:
        return {"direct": self.direct, "resolved": self.resolved, "refused": self.refused}


_STATS = DirectCallStats()


class _Active:
    on = False


def stats() -> DirectCallStats:
    """The process's direct-call counters."""
    return _STATS


@contextlib.contextmanager
def direct_calls() -> Iterator[None]:
    """Installed blocks called inside this context run their graphs directly."""
    prior = _Active.on
    _Active.on = True
    try:
        yield
    finally:
        _Active.on = prior


def install(block: nn.Module) -> bool:
    """Put the dispatcher in front of ``block``'s compiled call (after ``block.compile``).

    Returns False (and changes nothing) when the block was not compiled with
    ``nn.Module.compile`` or is already installed.
    """
    compiled = getattr(block, "_compiled_call_impl", None)
    if compiled is None or isinstance(compiled, _DirectBlockCall):
        return False
    block._compiled_call_impl = _DirectBlockCall(block, compiled)
    return True


def cache_entries(code: types.CodeType) -> list:
    """Dynamo's cache entries (guards + transformed bytecode) on ``code``, one per graph."""
    try:
        from torch._C._dynamo.eval_frame import _debug_get_cache_entry_list
    except ImportError:  # pragma: no cover - a torch without the debug hook
        return []
    return list(_debug_get_cache_entry_list(code))


def _arg_key(value: Any) -> Any:
    """What Dynamo's guards can tell apart about one argument, as a hashable key."""
    if isinstance(value, torch.Tensor):
        if type(value) is not torch.Tensor and not isinstance(value, nn.Parameter):
            return _UNKEYABLE  # a subclass may carry guarded state of its own
        return (
            value.shape,
            value.stride(),
            value.dtype,
            value.device,
            value.requires_grad,
            value.is_inference(),
        )
    if value is None or isinstance(value, (bool, int, float, str)):
        # The type keeps True apart from 1 (Dynamo guards on both).
        return (type(value), value)
    return _UNKEYABLE


def _call_key(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, ...] | None:
    parts: list[Any] = [torch.is_grad_enabled(), torch.is_inference_mode_enabled()]
    for value in args:
        key = _arg_key(value)
        if key is _UNKEYABLE:
            return None
        parts.append(key)
    for name, value in kwargs.items():
        key = _arg_key(value)
        if key is _UNKEYABLE:
            return None
        parts.append((name, key))
    return tuple(parts)


def _has_hooks(block: nn.Module) -> bool:
    """Forward/backward hooks ``nn.Module._call_impl`` would run around ``forward``.

    The direct call skips ``_call_impl``, so a block with hooks (its own or
    global ones, the same checks as ``_call_impl``'s fast path) keeps the
    ordinary call.
    """
    return bool(
        block._forward_hooks
        or block._forward_pre_hooks
        or block._backward_hooks
        or block._backward_pre_hooks
        or nn_module._global_forward_hooks
        or nn_module._global_forward_pre_hooks
        or nn_module._global_backward_hooks
        or nn_module._global_backward_pre_hooks
    )


class _DirectBlockCall:
    """The dispatcher stored as a compiled block's ``_compiled_call_impl``."""

    def __init__(self, block: nn.Module, compiled: Callable[..., Any]) -> None:
        self._block = block
        self._compiled = compiled
        self._forward = type(block).forward
        self._signature = inspect.signature(self._forward)
        #: call signature -> the entry's bytecode bound to the block, or the
        #: ordinary compiled call when no single entry passes.
        self._calls: dict[tuple[Any, ...], Callable[..., Any]] = {}

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if not _Active.on or _has_hooks(self._block):
            return self._compiled(*args, **kwargs)
        key = _call_key(args, kwargs)
        if key is None:
            return self._compiled(*args, **kwargs)
        call = self._calls.get(key)
        if call is None:
            call = self._resolve(key, args, kwargs)
        if call is not self._compiled:
            _STATS.direct += 1
        return call(*args, **kwargs)

    def _resolve(
        self, key: tuple[Any, ...], args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> Callable[..., Any]:
        """The one cache entry whose full guards pass on these arguments, as a bound function."""
        forward = self._forward
        call: Callable[..., Any] = self._compiled
        try:
            bound = self._signature.bind(self._block, *args, **kwargs)
        except TypeError:
            bound = None
        if bound is not None:
            # Dynamo's guards read the frame's locals: the arguments with defaults.
            bound.apply_defaults()
            frame_locals = dict(bound.arguments)
            entries = [
                entry
                for entry in cache_entries(forward.__code__)
                if entry.guard_manager.check(frame_locals)
            ]
            closure = forward.__closure__ or ()
            if len(entries) == 1 and len(entries[0].code.co_freevars) == len(closure):
                direct = types.FunctionType(
                    entries[0].code,
                    forward.__globals__,
                    forward.__name__,
                    forward.__defaults__,
                    forward.__closure__,
                )
                direct.__kwdefaults__ = forward.__kwdefaults__
                call = types.MethodType(direct, self._block)
            else:
                logger.debug(
                    "%s: %d compiled graphs pass this call's guards; it stays on "
                    "torch.compile's call.",
                    type(self._block).__name__,
                    len(entries),
                )
        if call is self._compiled:
            _STATS.refused += 1
        else:
            _STATS.resolved += 1
        self._calls[key] = call
        return call
