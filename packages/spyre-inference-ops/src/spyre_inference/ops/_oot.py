"""Idempotent registration of the Spyre layer swaps in vLLM's out-of-tree registry.

vLLM 0.33 swaps a layer class at instantiation time: ``CustomOp.__new__`` and
``PluggableLayer.__new__`` look the class being built up *by its class name*
(``cls.__name__``) in ``op_registry_oot`` and instantiate the registered class
instead. ``UpstreamClass.register_oot(SpyreClass)`` fills that registry, keyed
by ``UpstreamClass.__name__``, and asserts the name is not yet taken.

General plugins load in every vLLM process and possibly more than once in one,
so the registration here checks first: a name already bound to our class is
left alone, a name bound to somebody else's class is an error that says whose.
Registration has to happen before the model is constructed, which is the case
for ``vllm.general_plugins`` (vLLM loads them before building any model).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

from vllm.model_executor.custom_op import op_registry_oot

T = TypeVar("T", bound=type)

#: Every (upstream class, Spyre class) pair declared with :func:`spyre_oot`.
_SWAPS: list[tuple[type, type]] = []


class SwapConflictError(RuntimeError):
    """Another out-of-tree plugin already replaced a layer the plugin replaces."""


def _register(upstream: type, spyre_cls: type) -> None:
    name = upstream.__name__
    current = op_registry_oot.get(name)
    if current is spyre_cls:
        return
    if current is not None:
        raise SwapConflictError(
            f"vLLM's {name} is already replaced by {current.__module__}."
            f"{current.__qualname__}; spyre-inference cannot also replace it with "
            f"{spyre_cls.__module__}.{spyre_cls.__qualname__}. Disable the other "
            "plugin (VLLM_PLUGINS lists the plugins to load)."
        )
    # register_oot keys the registry by the class it is called on.
    upstream.register_oot(spyre_cls)  # type: ignore[attr-defined]


def spyre_oot(upstream: type) -> Callable[[T], T]:
    """Class decorator: ``spyre_cls`` replaces ``upstream`` wherever vLLM builds it."""

    def decorator(spyre_cls: T) -> T:
        if not issubclass(spyre_cls, upstream):
            raise TypeError(f"{spyre_cls.__name__} must subclass {upstream.__name__}")
        _SWAPS.append((upstream, spyre_cls))
        _register(upstream, spyre_cls)
        return spyre_cls

    return decorator


def ensure_registered() -> None:
    """Re-assert every declared swap (a no-op when all are in place)."""
    for upstream, spyre_cls in _SWAPS:
        _register(upstream, spyre_cls)


def declared_swaps() -> dict[str, type]:
    """Upstream class name -> Spyre class, for every swap the package declares."""
    return {upstream.__name__: spyre_cls for upstream, spyre_cls in _SWAPS}
