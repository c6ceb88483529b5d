"""Spyre layer swaps for vLLM (filled in by the ops issue)."""

from spyre_inference.ops._version import __version__


def register_ops() -> None:
    """vLLM general-plugin hook (idempotent)."""


__all__ = ["__version__", "register_ops"]
