"""Without a sub-package it needs, the platform refuses to start, naming what to install.

Runs in the platform package's own test session (only the core installed). The
general-plugin packages (ops, models) are also tested with the full set
installed: leaving a plugin out of ``VLLM_PLUGINS`` is exactly what vLLM sees
without the package, and the message then says to enable it instead.
"""

from __future__ import annotations

import importlib.metadata
import re

import pytest

from spyre_inference.platform import discovery
from spyre_inference.testing.models import save_config_only, tiny_config


def _installed(dist: str) -> bool:
    try:
        importlib.metadata.distribution(dist)
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


@pytest.mark.skipif(
    _installed("spyre-inference-attention"), reason="the attention package is installed"
)
def test_engine_config_without_attention_package_names_it(tiny_llama) -> None:
    from vllm.engine.arg_utils import EngineArgs

    with pytest.raises(Exception, match=r"pip install spyre-inference-attention") as err:
        EngineArgs(model=str(tiny_llama), max_model_len=256).create_engine_config()
    assert "spyre_inference.attention_backends" in str(err.value)


@pytest.mark.skipif(_installed("spyre-inference-comms"), reason="the comms package is installed")
def test_tensor_parallel_without_comms_package_names_it(tiny_llama) -> None:
    from vllm.engine.arg_utils import EngineArgs

    args = EngineArgs(model=str(tiny_llama), max_model_len=256, tensor_parallel_size=2)
    with pytest.raises(Exception, match=r"spyre-inference-comms"):
        args.create_engine_config()


def test_unknown_entry_point_names_group_and_distribution() -> None:
    with pytest.raises(discovery.MissingPackageError) as err:
        discovery.resolve_qualname(discovery.ATTENTION_BACKENDS_GROUP, "nonexistent", "a backend")
    assert "spyre-inference-attention" in str(err.value)
    assert "nonexistent" in str(err.value)


@pytest.fixture
def platform_plugin_only(monkeypatch):
    monkeypatch.setenv("VLLM_PLUGINS", "spyre")


def _fix(plugin: str, dist: str) -> str:
    """The fix the message must give: enable an installed plugin, else install it."""
    if _installed(dist):
        return f"add {plugin} to VLLM_PLUGINS"
    return f"pip install {dist}"


def _config_error(model) -> str:
    from vllm.engine.arg_utils import EngineArgs

    with pytest.raises(Exception) as err:
        EngineArgs(model=str(model), max_model_len=256).create_engine_config()
    return str(err.value)


def test_head_dim_that_needs_padding_without_ops_names_it(tmp_path, platform_plugin_only) -> None:
    model = save_config_only(tiny_config("llama", head_dim=32), tmp_path / "llama-head32")
    message = _config_error(model)
    assert re.search(r"head_dim=32 is not a multiple of the 64-element Spyre stick", message)
    assert _fix("spyre_ops", "spyre-inference-ops") in message, message


def test_moe_without_models_package_names_it(tmp_path, platform_plugin_only) -> None:
    model = save_config_only(tiny_config("mixtral"), tmp_path / "mixtral")
    message = _config_error(model)
    assert "MixtralForCausalLM is a mixture-of-experts model" in message, message
    assert _fix("spyre_models", "spyre-inference-models") in message, message


@pytest.mark.skipif(
    _installed("spyre-inference-attention"), reason="the attention package is installed"
)
def test_every_missing_package_is_named_at_once(tmp_path, platform_plugin_only) -> None:
    model = save_config_only(tiny_config("mixtral", head_dim=32), tmp_path / "mixtral-head32")
    message = _config_error(model)
    for dist in ("spyre-inference-attention", "spyre-inference-ops", "spyre-inference-models"):
        assert f"pip install {dist}" in message, message
