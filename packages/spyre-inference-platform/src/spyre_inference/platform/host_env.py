"""The CUDA runtime calls that vLLM's GPU worker and runner make unconditionally.

``GPUModelRunner`` and ``gpu_worker.Worker`` are the classes the spec builds
on, but their constructors create CUDA streams and events and their step loop
calls ``torch.accelerator.synchronize``/``empty_cache``. Neither the host nor a
Spyre card has those (torch-spyre does not implement the accelerator stream
API). vLLM offers no hook to choose these objects, so this module replaces
them with inert placeholders; it is one of the plugin's three runtime patches
(the others: :mod:`~spyre_inference.platform.float16_models` and
:mod:`~spyre_inference.platform.ray_resource`) and is kept here, isolated, so
it can be deleted once vLLM grows a hook.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

_done = False


def _noop(*args: Any, **kwargs: Any) -> None:
    return None


def _empty_cache_noop(*args: Any, **kwargs: Any) -> None:
    # A distinct function object from _noop: Dynamo keys its handling of
    # torch.accelerator.synchronize on the function identity.
    return None


def neutralize_cuda_runtime() -> None:
    """Make ``torch.accelerator.synchronize/empty_cache`` no-ops (idempotent).

    Work on both targets is issued synchronously from the worker's thread, so
    there is nothing to wait for.
    """
    global _done
    if _done:
        return
    torch.accelerator.synchronize = _noop
    torch.accelerator.empty_cache = _empty_cache_noop
    torch.accelerator.empty_host_cache = _empty_cache_noop
    _done = True


class _EventPlaceholder:
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def record(self, *args: Any, **kwargs: Any) -> None:
        return None

    def synchronize(self) -> None:
        return None

    def wait(self, *args: Any, **kwargs: Any) -> None:
        return None

    def query(self) -> bool:
        return True


class _StreamPlaceholder:
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.device = torch.device("cpu")

    def wait_stream(self, *args: Any, **kwargs: Any) -> None:
        return None

    def synchronize(self) -> None:
        return None


@contextlib.contextmanager
def cuda_stream_placeholders() -> Iterator[None]:
    """While the runner is constructed, streams and events are placeholders.

    Scoped to construction: the runner keeps the placeholder objects it
    built, and nothing else in the process sees the substitution.
    """
    saved = torch.Event, torch.cuda.Stream, torch.cuda.Event
    try:
        torch.Event = _EventPlaceholder  # type: ignore[misc,assignment]
        torch.cuda.Stream = _StreamPlaceholder  # type: ignore[misc,assignment]
        torch.cuda.Event = _EventPlaceholder  # type: ignore[misc,assignment]
        yield
    finally:
        torch.Event, torch.cuda.Stream, torch.cuda.Event = saved
