"""Finding the other sub-packages through entry points.

The core never imports the attention, comms, ops or models packages by name:
each one publishes what it provides in an entry-point group of the core, and
the core resolves names there. A missing package is a start-up error that
names the distribution to install.
"""

from __future__ import annotations

from importlib.metadata import EntryPoint, entry_points

ATTENTION_BACKENDS_GROUP = "spyre_inference.attention_backends"
COMMUNICATORS_GROUP = "spyre_inference.communicators"

#: Which distribution fills each group, for the error message.
PROVIDERS = {
    ATTENTION_BACKENDS_GROUP: "spyre-inference-attention",
    COMMUNICATORS_GROUP: "spyre-inference-comms",
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
