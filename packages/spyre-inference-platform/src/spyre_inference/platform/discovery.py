"""Finding the other sub-packages through entry points.

The core never imports the attention, comms, ops or models packages by name:
each one publishes what it provides in an entry-point group of the core, and
the core resolves names there. A missing package is a start-up error that
names the distribution to install.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from importlib.metadata import EntryPoint, entry_points
from typing import Any

ATTENTION_BACKENDS_GROUP = "spyre_inference.attention_backends"
COMMUNICATORS_GROUP = "spyre_inference.communicators"
#: Start-up checks a sub-package owns: ``name = "module:function"``, where the
#: function takes the ``VllmConfig`` and raises ``ValueError`` (with the
#: setting and the fix in its message) for a configuration it cannot serve.
CONFIG_CHECKS_GROUP = "spyre_inference.config_checks"

#: Which distribution fills each group, for the error message.
PROVIDERS = {
    ATTENTION_BACKENDS_GROUP: "spyre-inference-attention",
    COMMUNICATORS_GROUP: "spyre-inference-comms",
}

#: The sub-packages that enter vLLM as general plugins: plugin name -> distribution.
GENERAL_PLUGINS = {
    "spyre_ops": "spyre-inference-ops",
    "spyre_models": "spyre-inference-models",
}


class MissingPackageError(RuntimeError):
    """A sub-package the configuration needs is not installed."""


def _entry_points(group: str) -> dict[str, EntryPoint]:
    return {ep.name: ep for ep in entry_points(group=group)}


def resolve_qualname(group: str, name: str, purpose: str) -> str:
    """The ``module.Class`` path registered under ``name`` in ``group``.

    Returned as a string (not imported) because vLLM resolves backend and
    communicator classes by qualified name itself, in the process that needs
    them.
    """
    eps = _entry_points(group)
    ep = eps.get(name)
    if ep is None:
        dist = PROVIDERS.get(group, "the providing package")
        found = ", ".join(sorted(eps)) or "none"
        raise MissingPackageError(
            f"spyre-inference needs {purpose} '{name}' from the entry-point group "
            f"'{group}', but it is not installed (found: {found}). "
            f"Install the '{dist}' distribution (pip install {dist}), or the "
            "full set with 'pip install spyre-inference'."
        )
    module, _, attr = ep.value.partition(":")
    return f"{module}.{attr}" if attr else module


def available(group: str) -> list[str]:
    return sorted(_entry_points(group))


def general_plugin_installed(name: str) -> bool:
    """Whether a distribution publishes the ``vllm.general_plugins`` entry ``name``."""
    return any(ep.name == name for ep in entry_points(group="vllm.general_plugins"))


def general_plugin_filtered(name: str) -> bool:
    """Whether ``VLLM_PLUGINS`` is set and leaves the plugin ``name`` out."""
    allowed = os.environ.get("VLLM_PLUGINS")
    return allowed is not None and name not in allowed.split(",")


def general_plugin_enabled(name: str) -> bool:
    """Whether vLLM loads the general plugin ``name`` (installed and not filtered)."""
    return general_plugin_installed(name) and not general_plugin_filtered(name)


def how_to_enable(name: str) -> str:
    """What to do so that vLLM loads the general plugin ``name``."""
    dist = GENERAL_PLUGINS[name]
    if general_plugin_installed(name):
        return f"add {name} to VLLM_PLUGINS (it is installed but VLLM_PLUGINS leaves it out)"
    return f"pip install {dist} (or the full set, spyre-inference)"


def config_checks() -> dict[str, Callable[[Any], None]]:
    """The start-up checks of every installed sub-package, by entry-point name."""
    return {name: ep.load() for name, ep in sorted(_entry_points(CONFIG_CHECKS_GROUP).items())}
