"""The architecture tables and their registration with vLLM's ModelRegistry."""

from __future__ import annotations

import importlib
from importlib.metadata import entry_points

import pytest
from vllm.model_executor.models.registry import _VLLM_MODELS, ModelRegistry, _LazyRegisteredModel

import spyre_inference.models as models
from spyre_inference.models import (
    UnknownArchitectureError,
    check_against_vllm,
    register_model_table,
    register_models,
    spyre_models,
    upstream_class_of,
)


def _load(target: str) -> type:
    module, _, name = target.partition(":")
    return getattr(importlib.import_module(module), name)


def _upstream(arch: str) -> type:
    module, name = _VLLM_MODELS[arch]
    if not module.startswith("vllm."):
        module = f"vllm.model_executor.models.{module}"
    return getattr(importlib.import_module(module), name)


def test_every_adapted_class_subclasses_the_class_vllm_resolves_to() -> None:
    table = spyre_models()
    assert table, "no adapted architectures"
    for arch, target in table.items():
        spyre_cls, upstream = _load(target), _upstream(arch)
        assert spyre_cls.__name__ == f"Spyre{upstream.__name__}", (arch, target)
        assert issubclass(spyre_cls, upstream), (arch, spyre_cls, upstream)


def test_shipped_tables_pass_the_check() -> None:
    check_against_vllm(spyre_models())


def test_unknown_architecture_fails_registration_naming_it() -> None:
    table = {
        **spyre_models(),
        "SpyreNoSuchModelForCausalLM": "spyre_inference.models.x:SpyreTransformersForCausalLM",
    }
    before = dict(ModelRegistry.models)
    with pytest.raises(UnknownArchitectureError, match="'SpyreNoSuchModelForCausalLM'"):
        register_model_table(table)
    # All or nothing: the valid entries of the failing table were not registered either.
    assert dict(ModelRegistry.models) == before


def test_unknown_name_in_the_package_table_fails_register_models(monkeypatch) -> None:
    """The entry point itself refuses a table naming an architecture vLLM lacks."""
    monkeypatch.setitem(models._ADAPTED_ARCHS, "LlamaForCausalLMv9", "TransformersForCausalLM")
    with pytest.raises(UnknownArchitectureError) as info:
        register_models()
    assert "'LlamaForCausalLMv9'" in str(info.value)
    assert "unknown to vLLM's model registry" in str(info.value)


def test_architecture_mapped_to_another_upstream_class_fails() -> None:
    # vLLM maps LlamaForCausalLM to LlamaForCausalLM, not to TransformersForCausalLM.
    table = {"LlamaForCausalLM": "spyre_inference.models.x:SpyreTransformersForCausalLM"}
    with pytest.raises(UnknownArchitectureError) as info:
        check_against_vllm(table)
    message = str(info.value)
    assert "'LlamaForCausalLM'" in message and "'TransformersForCausalLM'" in message


def test_register_models_is_lazy_and_idempotent() -> None:
    register_models()
    table = spyre_models()
    for arch, target in table.items():
        module, _, name = target.partition(":")
        assert ModelRegistry.models[arch] == _LazyRegisteredModel(module, name)
    # A second call (vLLM calls general plugins in every process, maybe twice)
    # finds everything in place.
    assert register_model_table(table) == []
    register_models()
    # vLLM resolves the architecture to the Spyre class.
    for arch, target in table.items():
        assert ModelRegistry._try_load_model_cls(arch) is _load(target)


def test_upstream_class_of() -> None:
    assert upstream_class_of("a.b:SpyreFooModel") == "FooModel"
    with pytest.raises(ValueError):
        upstream_class_of("a.b:FooModel")


def test_entry_point_is_declared() -> None:
    (ep,) = [e for e in entry_points(group="vllm.general_plugins") if e.name == "spyre_models"]
    assert ep.value == "spyre_inference.models:register_models"
    assert ep.load() is register_models
