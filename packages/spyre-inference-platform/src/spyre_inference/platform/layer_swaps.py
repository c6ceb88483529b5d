"""The one swap API: how a plugin package replaces a vLLM layer class with its Spyre class.

Two kinds of upstream layer exist, so there are two ways in:

* **Registry swaps** (:func:`spyre_oot`, :func:`register_swap`) for vLLM's
  ``CustomOp`` and ``PluggableLayer`` classes. vLLM 0.33 swaps these at
  instantiation time: their ``__new__`` looks the class being built up *by its
  class name* in ``op_registry_oot``, which ``UpstreamClass.register_oot(Spyre)``
  fills (asserting the name is free). This is vLLM's documented extension point
  and the one to prefer.
* **Built-module swaps** (:func:`spyre_replaces_built`) for layers that are
  plain ``nn.Module`` subclasses, which the registry never sees (vLLM 0.33's
  ``Phi3LongRoPEScaledRotaryEmbedding``, built by ``get_rope`` inside every
  attention layer). The runner calls :func:`swap_built_modules` once, right after
  ``get_model`` and before anything moves to the device or compiles; each
  instance of the upstream class is replaced by ``SpyreClass.from_upstream(it)``
  (one replacement per instance, so modules vLLM shares between layers stay
  shared).

General plugins load in every vLLM process and possibly more than once in one,
so registration checks first: a name already bound to our class is left alone,
a name bound to somebody else's class is an error that says whose.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol, TypeVar

from torch import nn

T = TypeVar("T", bound=type)

#: Every (upstream class, Spyre class) registry swap, in declaration order.
_REGISTRY_SWAPS: dict[type, type] = {}
#: Upstream ``nn.Module`` class -> Spyre class, for built-module swaps.
_BUILT_SWAPS: dict[type, type] = {}


class SwapConflictError(RuntimeError):
    """Another out-of-tree plugin already replaced a layer spyre-inference replaces."""


class BuiltModuleSwap(Protocol):
    """A Spyre class that replaces an already-built upstream module."""

    @classmethod
    def from_upstream(cls, upstream: Any) -> nn.Module:
        """The Spyre module equivalent to ``upstream`` (same configuration)."""
        ...


def _check_subclass(upstream: type, spyre_cls: type) -> None:
    if not issubclass(spyre_cls, upstream):
        raise TypeError(f"{spyre_cls.__name__} must subclass {upstream.__name__}")


def _register_with_vllm(upstream: type, spyre_cls: type) -> None:
    from vllm.model_executor.custom_op import op_registry_oot

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


def register_swap(upstream: type, spyre_cls: type) -> None:
    """Make vLLM build ``spyre_cls`` wherever it builds ``upstream`` (idempotent)."""
    _check_subclass(upstream, spyre_cls)
    if not hasattr(upstream, "register_oot"):
        raise TypeError(
            f"{upstream.__name__} is not a vLLM CustomOp or PluggableLayer, so vLLM's "
            "out-of-tree registry never builds a replacement for it; declare "
            f"{spyre_cls.__name__} with spyre_replaces_built instead."
        )
    _register_with_vllm(upstream, spyre_cls)
    _REGISTRY_SWAPS[upstream] = spyre_cls


def spyre_oot(upstream: type) -> Callable[[T], T]:
    """Class decorator: the decorated class replaces ``upstream`` wherever vLLM builds it."""

    def decorator(spyre_cls: T) -> T:
        register_swap(upstream, spyre_cls)
        return spyre_cls

    return decorator


def spyre_replaces_built(upstream: type[nn.Module]) -> Callable[[T], T]:
    """Class decorator: instances of ``upstream`` are replaced after the model is built.

    For plain ``nn.Module`` layers only (vLLM's registry cannot reach them);
    the decorated class must define ``from_upstream`` (:class:`BuiltModuleSwap`).
    """

    def decorator(spyre_cls: T) -> T:
        _check_subclass(upstream, spyre_cls)
        if hasattr(upstream, "register_oot"):
            raise TypeError(
                f"{upstream.__name__} is in vLLM's out-of-tree registry: use spyre_oot."
            )
        if not callable(getattr(spyre_cls, "from_upstream", None)):
            raise TypeError(f"{spyre_cls.__name__} must define a from_upstream classmethod")
        _BUILT_SWAPS[upstream] = spyre_cls
        return spyre_cls

    return decorator


def ensure_registered() -> None:
    """Re-assert every registry swap (a no-op when all are in place; tests reset vLLM's)."""
    for upstream, spyre_cls in _REGISTRY_SWAPS.items():
        _register_with_vllm(upstream, spyre_cls)


def declared_swaps(package: str | None = None) -> dict[str, type]:
    """Upstream class name -> Spyre class, for every swap of both kinds.

    ``package`` (for example ``"spyre_inference.ops"``) keeps the swaps whose
    Spyre class is defined under it.
    """
    swaps = {up.__name__: cls for up, cls in {**_REGISTRY_SWAPS, **_BUILT_SWAPS}.items()}
    if package is None:
        return swaps
    prefix = package + "."
    return {name: cls for name, cls in swaps.items() if cls.__module__.startswith(prefix)}


def swap_built_modules(model: nn.Module) -> dict[str, str]:
    """Replace every built-module swap's upstream instance in ``model``; idempotent.

    Matching is by exact type, as vLLM's registry matches by exact class name: a
    subclass of a swapped class is a different layer. Returns
    ``{qualified child name: Spyre class name}`` for what was replaced.
    """
    if not _BUILT_SWAPS:
        return {}
    replacements: dict[int, nn.Module] = {}
    replaced: dict[str, str] = {}
    for parent_name, parent in list(model.named_modules(remove_duplicate=False)):
        for child_name, child in list(parent.named_children()):
            spyre_cls = _BUILT_SWAPS.get(type(child))
            if spyre_cls is None:
                continue
            new = replacements.get(id(child))
            if new is None:
                new = replacements[id(child)] = spyre_cls.from_upstream(child)
            setattr(parent, child_name, new)
            replaced[f"{parent_name}.{child_name}" if parent_name else child_name] = (
                spyre_cls.__name__
            )
    return replaced


__all__ = [
    "BuiltModuleSwap",
    "SwapConflictError",
    "declared_swaps",
    "ensure_registered",
    "register_swap",
    "spyre_oot",
    "spyre_replaces_built",
    "swap_built_modules",
]
