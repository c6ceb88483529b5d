"""Spyre model adaptations for vLLM (filled in by the models issue)."""

from spyre_inference.models._version import __version__


def register_models() -> None:
    """vLLM general-plugin hook (idempotent)."""


__all__ = ["__version__", "register_models"]
