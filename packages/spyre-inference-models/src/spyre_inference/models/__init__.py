"""Spyre model adaptations for vLLM: per-architecture subclasses and their registry.

Some models need more than a swapped layer (that is the ops package's job): a
different transport for an input, a rotary form vLLM's layer registry cannot
reach, an expert dispatch Spyre can lower. Each lives in its own module here as
a subclass of the upstream vLLM class; ``_``-prefixed modules hold machinery the
subclasses share and register no architecture of their own.

Two tables say which architectures are adapted:

* :data:`_ADAPTED_MODULES`: adaptation module -> the upstream vLLM classes it
  adapts. Each adapted class is named ``Spyre`` + the upstream class name.
* :data:`_ADAPTED_ARCHS`: architecture name (as in a checkpoint's
  ``config.json`` / vLLM's registry) -> the upstream class vLLM resolves it to.

:func:`spyre_models` joins them into ``architecture -> "module:Class"``, and
:func:`register_models` (the ``vllm.general_plugins`` entry point) points vLLM's
``ModelRegistry`` at those targets. Registration is lazy: vLLM imports a target
only when it resolves that architecture. Before registering anything it checks
every architecture against vLLM's own model table, so an upstream rename (or a
typo here) fails loudly instead of silently serving the unadapted class.

:func:`register_models` also registers the out-of-tree MoE method
(:mod:`spyre_inference.models.moe`) and Mamba2 mixer
(:mod:`spyre_inference.models.mamba2`), layer swaps rather than architectures:
every MoE or Mamba2 model vLLM builds on this platform needs them.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping

from spyre_inference.models._version import __version__
from spyre_inference.platform import layer_swaps
from spyre_inference.platform.logs import get_logger

logger = get_logger(__name__)

#: Adaptation module (under ``spyre_inference.models``) -> upstream vLLM classes it adapts.
_ADAPTED_MODULES: dict[str, tuple[str, ...]] = {
    "bert": (
        "BertEmbeddingModel",
        "BertForSequenceClassification",
        "BertForTokenClassification",
    ),
    "roberta": (
        "RobertaEmbeddingModel",
        "RobertaForSequenceClassification",
        "RobertaForTokenClassification",
    ),
    "gemma4": ("Gemma4ForCausalLM",),
    "granitemoehybrid": ("GraniteMoeHybridForCausalLM",),
    "transformers_backend": ("TransformersForCausalLM", "TransformersMoEForCausalLM"),
}

#: vLLM architecture name -> the upstream class vLLM's own table maps it to.
_ADAPTED_ARCHS: dict[str, str] = {
    "BertModel": "BertEmbeddingModel",
    "BertForSequenceClassification": "BertForSequenceClassification",
    "BertForTokenClassification": "BertForTokenClassification",
    "RobertaModel": "RobertaEmbeddingModel",
    "RobertaForMaskedLM": "RobertaEmbeddingModel",
    "XLMRobertaModel": "RobertaEmbeddingModel",
    "RobertaForSequenceClassification": "RobertaForSequenceClassification",
    "XLMRobertaForSequenceClassification": "RobertaForSequenceClassification",
    "RobertaForTokenClassification": "RobertaForTokenClassification",
    "XLMRobertaForTokenClassification": "RobertaForTokenClassification",
    "Gemma4ForCausalLM": "Gemma4ForCausalLM",
    "GraniteMoeHybridForCausalLM": "GraniteMoeHybridForCausalLM",
    # model_impl="transformers" (and the automatic fallback) resolves text
    # generation models to these architecture names.
    "TransformersForCausalLM": "TransformersForCausalLM",
    "TransformersMoEForCausalLM": "TransformersMoEForCausalLM",
}

#: Layer swaps this package owns (imported, and so registered, by register_models).
_LAYER_SWAP_MODULES = ("spyre_inference.models.moe", "spyre_inference.models.mamba2")

SPYRE_PREFIX = "Spyre"


class UnknownArchitectureError(ValueError):
    """An adapted architecture that vLLM's own registry does not know (or maps elsewhere)."""


def _module_of(upstream_cls: str) -> str:
    for module, classes in _ADAPTED_MODULES.items():
        if upstream_cls in classes:
            return module
    raise UnknownArchitectureError(
        f"spyre-inference's architecture table names the upstream class {upstream_cls!r}, "
        "but no adaptation module in _ADAPTED_MODULES defines a Spyre class for it."
    )


#: The upstream classes vLLM's Transformers backend builds text generators with
#: (dense and mixture-of-experts); the multimodal and MTP ones are not adapted.
TRANSFORMERS_TEXT_GENERATORS = frozenset({"TransformersForCausalLM", "TransformersMoEForCausalLM"})


def transformers_backend_archs() -> dict[str, str]:
    """Architectures vLLM's own table serves with a Transformers backend text generator
    -> that class.

    vLLM 0.33 lists many text generators (Arcee, OLMo, OLMo 2/3, SmolLM3,
    Starcoder2, Seed-OSS, FlexOlmo, HunYuan MoE, ...) under their own names with
    the Transformers backend's class as the target, so they never pass through
    the ``TransformersForCausalLM`` name: each must be registered to the Spyre
    class itself, or the model runs Hugging Face's own RoPE (wrong once the
    platform has widened ``head_dim`` to whole sticks).
    """
    from vllm.model_executor.models.registry import _VLLM_MODELS

    return {
        arch: upstream
        for arch, (_, upstream) in _VLLM_MODELS.items()
        if upstream in TRANSFORMERS_TEXT_GENERATORS
    }


def spyre_models() -> dict[str, str]:
    """Architecture name -> ``"spyre_inference.models.<module>:Spyre<UpstreamClass>"``.

    The values are the lazy ``module:Class`` targets vLLM's
    ``ModelRegistry.register_model`` accepts; no model module is imported here.
    """
    archs = {**transformers_backend_archs(), **_ADAPTED_ARCHS}
    return {
        arch: f"{__name__}.{_module_of(upstream)}:{SPYRE_PREFIX}{upstream}"
        for arch, upstream in archs.items()
    }


def upstream_class_of(target: str) -> str:
    """The upstream class name a ``module:SpyreClass`` target adapts."""
    class_name = target.rpartition(":")[2]
    if not class_name.startswith(SPYRE_PREFIX):
        raise ValueError(f"{target!r} does not name a {SPYRE_PREFIX}-prefixed class")
    return class_name[len(SPYRE_PREFIX) :]


def check_against_vllm(table: Mapping[str, str]) -> None:
    """Fail unless vLLM's own model table maps every architecture to the adapted class.

    ``table`` is ``architecture -> "module:SpyreUpstreamClass"`` (the form of
    :func:`spyre_models`). Every problem is reported at once.
    """
    from vllm.model_executor.models.registry import _VLLM_MODELS

    unknown = sorted(arch for arch in table if arch not in _VLLM_MODELS)
    moved = {
        arch: (upstream_class_of(target), _VLLM_MODELS[arch][1])
        for arch, target in table.items()
        if arch in _VLLM_MODELS and _VLLM_MODELS[arch][1] != upstream_class_of(target)
    }
    if not unknown and not moved:
        return
    problems = []
    if unknown:
        problems.append("unknown to vLLM's model registry: " + ", ".join(repr(a) for a in unknown))
    for arch, (ours, theirs) in sorted(moved.items()):
        problems.append(
            f"{arch!r} is adapted from {ours!r}, but vLLM now resolves it to {theirs!r}"
        )
    raise UnknownArchitectureError(
        "spyre-inference cannot register its model adaptations; architecture(s) "
        + "; ".join(problems)
        + ". The vLLM release differs from the one these adaptations were written for: "
        "update spyre_inference.models' tables (or install the matching vLLM)."
    )


def register_model_table(table: Mapping[str, str]) -> list[str]:
    """Check ``table`` against vLLM, then register every entry lazily (idempotent).

    Nothing is registered if any architecture fails the check. Returns the
    architectures newly registered by this call.
    """
    from vllm.model_executor.models.registry import ModelRegistry, _LazyRegisteredModel

    check_against_vllm(table)
    added = []
    for arch, target in table.items():
        module_name, _, class_name = target.partition(":")
        if ModelRegistry.models.get(arch) == _LazyRegisteredModel(module_name, class_name):
            continue
        ModelRegistry.register_model(arch, target)
        added.append(arch)
    return added


def register_layer_swaps() -> None:
    """Import (and so register) the layer swaps this package owns; idempotent."""
    for name in _LAYER_SWAP_MODULES:
        importlib.import_module(name)
    # Imports are cached: if vLLM's registry was reset since (tests do), this
    # puts the swaps back; otherwise it only checks them.
    layer_swaps.ensure_registered()


def register_models() -> None:
    """vLLM general-plugin hook: register the model adaptations (idempotent).

    vLLM runs general plugins in every process it starts, possibly more than
    once per process; a second call finds everything in place and does nothing.
    """
    added = register_model_table(spyre_models())
    register_layer_swaps()
    if added:
        logger.info("spyre-inference model adaptations registered: %s", ", ".join(sorted(added)))


__all__ = [
    "TRANSFORMERS_TEXT_GENERATORS",
    "UnknownArchitectureError",
    "__version__",
    "check_against_vllm",
    "register_layer_swaps",
    "register_model_table",
    "register_models",
    "spyre_models",
    "transformers_backend_archs",
    "upstream_class_of",
]
