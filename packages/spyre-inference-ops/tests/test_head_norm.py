"""Per-head q/k norms (Qwen3, Gemma 3) at a stick-padded head size equal upstream's unpadded.

A head of 32 is widened to 64 in the ``[x1, 0, x2, 0]`` layout of
``stick_pad_load.pad_heads``; the norm is built at 64 and loaded with the
32-entry checkpoint weight through its weight loader, as vLLM's model loaders
do. The reference is vLLM's own ``RMSNorm``/``GemmaRMSNorm`` at 32 on the
unpadded activations. float32 within 1e-5; the padded lanes must stay zero.
A hidden-size norm that happens to be 64 wide loads a 64-entry tensor and stays
an ordinary norm.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
from ops_testutil import default_dtype, tol, upstream_layers

from spyre_inference.ops.stick_pad_load import pad_heads
from spyre_inference.platform.stick_pad import PLAN_KEY, DimPad, StickPadPlan

HEAD, PADDED = 32, 64
PAD = DimPad(HEAD, PADDED)


@contextlib.contextmanager
def padded_config():
    from vllm.config import VllmConfig, set_current_vllm_config

    plan = StickPadPlan(head_dim=PAD, intermediate_size=None)
    with set_current_vllm_config(VllmConfig(additional_config={PLAN_KEY: plan.to_dict()})):
        yield


def _norm_classes():
    from vllm.model_executor.layers.layernorm import GemmaRMSNorm, RMSNorm

    return {"rms": RMSNorm, "gemma": GemmaRMSNorm}


@pytest.mark.parametrize("kind", ["rms", "gemma"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_padded_head_norm_equals_unpadded(vllm_env, kind, dtype):
    cls = _norm_classes()[kind]
    g = torch.Generator().manual_seed(3)
    weight = torch.randn(HEAD, generator=g) * 0.2 + (1.0 if kind == "rms" else 0.0)
    x = torch.randn(7, 4, HEAD, generator=g).to(dtype)  # tokens, heads, head_dim

    with default_dtype(dtype), upstream_layers():
        ref_norm = cls(HEAD, eps=1e-6)
    ref_norm.weight.data.copy_(weight.to(dtype))
    ref = ref_norm.forward_native(x)

    with default_dtype(dtype), padded_config():
        norm = cls(PADDED, eps=1e-6)
    assert type(norm).__name__.startswith("Spyre")
    norm.weight.weight_loader(norm.weight, weight.to(dtype))
    assert norm.weight.shape == (PADDED,)
    assert norm.variance_width == HEAD

    x_padded = pad_heads(x.reshape(-1, HEAD), 1, PAD).reshape(7, 4, PADDED)
    out = norm(x_padded).reshape(-1, PADDED)
    kept = out.view(-1, 2, PADDED // 2)[..., : HEAD // 2].reshape(7, 4, HEAD)
    torch.testing.assert_close(kept, ref, **tol(dtype))
    assert not out.view(-1, 2, PADDED // 2)[..., HEAD // 2 :].any()


def test_full_width_norm_of_padded_size_stays_ordinary(vllm_env):
    """hidden_size == padded head size: the 64-entry checkpoint tensor keeps it a plain norm."""
    from vllm.model_executor.layers.layernorm import RMSNorm

    g = torch.Generator().manual_seed(4)
    weight = torch.randn(PADDED, generator=g)
    x = torch.randn(5, PADDED, generator=g)
    with upstream_layers():
        ref_norm = RMSNorm(PADDED, eps=1e-6)
    ref_norm.weight.data.copy_(weight)
    with padded_config():
        norm = RMSNorm(PADDED, eps=1e-6)
    norm.weight.weight_loader(norm.weight, weight)
    assert norm.variance_width is None
    torch.testing.assert_close(norm(x), ref_norm.forward_native(x), rtol=1e-6, atol=1e-6)
