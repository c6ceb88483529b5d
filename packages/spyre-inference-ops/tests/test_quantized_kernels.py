"""The 8-bit kernels' registration in vLLM's kernel tables, and the FP8 quantization ops.

vLLM picks a linear kernel for a quantized method from per-platform tables; the
ops package adds its kernels under ``PlatformEnum.OOT`` (idempotently), and
defines the three FP8 quantization ops a vLLM built without its ``_C``
library lacks. The ops are checked through vLLM's own wrapper
(``vllm._custom_ops.scaled_fp8_quant``) against vLLM's test-suite references
(``tests/kernels/quant_utils.py`` in the sdist), exactly.
"""

from __future__ import annotations

import importlib.util
import sys

import pytest
import torch


def test_kernels_are_in_vllms_tables_once(vllm_env) -> None:
    from vllm.model_executor.kernels import linear
    from vllm.platforms import PlatformEnum

    from spyre_inference.ops import quantized_linear, register_ops

    register_ops()
    register_ops()
    for table, kernels in quantized_linear.KERNEL_TABLES.items():
        entries = getattr(linear, table)[PlatformEnum.OOT]
        assert entries[: len(kernels)] == list(kernels), table
        assert len(entries) == len(set(entries)), table


@pytest.fixture(scope="module")
def ref_utils(tmp_path_factory):
    from spyre_inference.testing.vllm_tests import extract_tests

    root = extract_tests("tests/kernels/quant_utils.py", tmp_path_factory.mktemp("vllm-tests"))
    spec = importlib.util.spec_from_file_location(
        "vllm_quant_utils", root / "tests" / "kernels" / "quant_utils.py"
    )
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def test_fp8_quant_ops_equal_vllms_references(vllm_env, ref_utils) -> None:
    from vllm import _custom_ops as ops

    from spyre_inference.ops import register_ops

    register_ops()
    x = torch.randn(7, 96, generator=torch.Generator().manual_seed(0)) * 3
    x[3] = 0.0  # a zero row: the floor on the scale keeps it finite

    got, scale = ops.scaled_fp8_quant(x, use_per_token_if_dynamic=True)
    want, want_scale = ref_utils.ref_dynamic_per_token_quant(x, torch.float8_e4m3fn)
    assert torch.equal(scale, want_scale)
    assert torch.equal(got.float(), want.float())

    got, scale = ops.scaled_fp8_quant(x)
    want, want_scale = ref_utils.ref_dynamic_per_tensor_fp8_quant(x)
    assert torch.equal(scale.reshape(()), want_scale.reshape(()))
    assert torch.equal(got.float(), want.float())

    # Static: the scale given (as online fp8 quantizes a weight with its amax).
    static = torch.tensor([0.02])
    got, _ = ops.scaled_fp8_quant(x, scale=static)
    assert torch.equal(got.float(), (x / 0.02).clamp(-448, 448).to(torch.float8_e4m3fn).float())
