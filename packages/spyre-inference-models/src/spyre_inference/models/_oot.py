"""Idempotent registration of this package's layer swaps in vLLM's out-of-tree registry.

vLLM swaps a ``CustomOp`` at construction by looking the class *name* up in
``op_registry_oot`` (``UpstreamClass.register_oot(SpyreClass)`` fills it and
asserts the name is free). General plugins run in every vLLM process, possibly
more than once, so registration checks first: a name already bound to our
class is left alone; a name bound to another plugin's class is an error that
says whose.
"""

from __future__ import annotations

from vllm.model_executor.custom_op import op_registry_oot


class SwapConflictError(RuntimeError):
    """Another out-of-tree plugin already replaced a layer this package replaces."""


def register_swap(upstream: type, spyre_cls: type) -> None:
    """Make vLLM build ``spyre_cls`` wherever it builds ``upstream`` (idempotent)."""
    if not issubclass(spyre_cls, upstream):
        raise TypeError(f"{spyre_cls.__name__} must subclass {upstream.__name__}")
    name = upstream.__name__
    current = op_registry_oot.get(name)
    if current is spyre_cls:
        return
    if current is not None:
        raise SwapConflictError(
            f"vLLM's {name} is already replaced by {current.__module__}."
            f"{current.__qualname__}; spyre-inference cannot also replace it with "
            f"{spyre_cls.__module__}.{spyre_cls.__qualname__}. Disable the other plugin "
            "(VLLM_PLUGINS lists the plugins to load)."
        )
    upstream.register_oot(spyre_cls)  # type: ignore[attr-defined]
