"""spyre-inference platform core: the vLLM platform plugin for IBM Spyre.

Entry point ``vllm.platform_plugins: spyre = spyre_inference.platform:register``.

Device placement lives in :mod:`spyre_inference.platform.device` (import the
module: ``from spyre_inference.platform import device``).
"""

from spyre_inference.platform._version import __version__
from spyre_inference.platform.device import (
    STICK_ELEMS,
    DeviceTarget,
    is_spyre,
    round_up,
    target,
    to_device,
    to_host,
)

PLATFORM_QUALNAME = "spyre_inference.platform.platform.TorchSpyrePlatform"


def register() -> str | None:
    """vLLM platform-plugin hook: always activates (cpu target without a card).

    Returning the qualified name lets vLLM import the platform lazily; the
    target (spyre or cpu) is decided when the platform class is first used.
    """
    return PLATFORM_QUALNAME


__all__ = [
    "PLATFORM_QUALNAME",
    "STICK_ELEMS",
    "DeviceTarget",
    "__version__",
    "is_spyre",
    "register",
    "round_up",
    "target",
    "to_device",
    "to_host",
]
