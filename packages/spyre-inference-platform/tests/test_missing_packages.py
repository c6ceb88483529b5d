"""Without the attention package the platform refuses to start, naming what to install.

Runs in the platform package's own test session (only the core installed);
with the full set installed there is nothing missing to test.
"""

from __future__ import annotations

import importlib.metadata

import pytest

from spyre_inference.platform import discovery


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
