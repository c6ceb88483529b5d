"""Configurations the plugin cannot serve fail at start-up, naming the setting and the fix.

Built through ``EngineArgs.create_engine_config`` — the same path ``LLM(...)``
and ``vllm serve`` take before any engine process starts — so the error
reaches the user's own process.
"""

from __future__ import annotations

import pytest
import torch
from vllm.engine.arg_utils import EngineArgs

from spyre_inference.platform import device, settings
from spyre_inference.platform.platform import TorchSpyrePlatform


@pytest.fixture(autouse=True)
def _fresh_settings(monkeypatch):
    device.reset_for_tests()
    yield
    device.reset_for_tests()


def _config(model, **kwargs):
    return EngineArgs(model=str(model), max_model_len=256, **kwargs).create_engine_config()


def test_data_parallel_is_rejected(tiny_llama) -> None:
    with pytest.raises(ValueError, match=r"data_parallel_size=2 .*Remove --data-parallel-size"):
        _config(tiny_llama, data_parallel_size=2)


def test_kv_cache_dtype_other_than_model_dtype_is_rejected(tiny_llama) -> None:
    with pytest.raises(ValueError, match=r"--kv-cache-dtype fp8 is not supported"):
        _config(tiny_llama, kv_cache_dtype="fp8")


def test_dtype_outside_the_target_is_rejected(tiny_llama) -> None:
    # float64 never reaches the platform: vLLM's own validation refuses it.
    with pytest.raises(ValueError, match="dtype"):
        _config(tiny_llama, dtype="float64")
    # The spyre target's rule (float16 only), checked by the same code the
    # platform runs at start-up on a card.
    with pytest.raises(ValueError, match=r"--dtype bfloat16 is not supported on the spyre target"):
        TorchSpyrePlatform._check_dtype(torch.bfloat16, device.DeviceTarget.SPYRE)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
def test_cpu_target_accepts_its_dtypes(tiny_llama, dtype) -> None:
    assert _config(tiny_llama, dtype=dtype).model_config.dtype == getattr(torch, dtype)


def test_block_size_default_and_rounding(tiny_llama) -> None:
    assert _config(tiny_llama).cache_config.block_size == 128
    assert _config(tiny_llama, block_size=100).cache_config.block_size == 128
    assert _config(tiny_llama, block_size=64).cache_config.block_size == 64


def test_unknown_setting_value_names_the_variable(tiny_llama, monkeypatch) -> None:
    monkeypatch.setenv("SPYRE_ATTN_KV_LAYOUT", "diagonal")
    settings.reset_cache()
    with pytest.raises(ValueError, match=r"SPYRE_ATTN_KV_LAYOUT='diagonal' .*token_major"):
        _config(tiny_llama)


def test_spyre_target_without_a_card_is_a_clear_error(tiny_llama, monkeypatch) -> None:
    monkeypatch.setenv("SPYRE_DEVICE_TARGET", "spyre")
    device.reset_for_tests()
    expected = r"SPYRE_DEVICE_TARGET=spyre but .*SPYRE_DEVICE_TARGET=cpu"
    with pytest.raises(RuntimeError, match=expected):
        device.target_choice()
