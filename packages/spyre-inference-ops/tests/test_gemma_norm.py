"""The Spyre Gemma RMSNorm against vLLM's own, and its "no float32" property.

Upstream computes in float32; the Spyre body stays in the activation dtype, so
in bfloat16 the two differ by bf16 rounding of the variance, of ``1 + w`` and of
the output: compared at rtol = atol = 3.2e-2 (two bf16 ulps, normalized outputs
of order 1). In float32 both are float32 computations: within 1e-5.
"""

from __future__ import annotations

import pytest
import torch
from ops_testutil import upstream_layers
from torch.utils._python_dispatch import TorchDispatchMode

HIDDEN = 256


def _norms(dtype):
    from vllm.model_executor.layers.layernorm import GemmaRMSNorm

    weight = torch.randn(HIDDEN, generator=torch.Generator().manual_seed(0)) * 0.1
    layers = []
    for suspend in (False, True):
        if suspend:
            with upstream_layers():
                layer = GemmaRMSNorm(HIDDEN, eps=1e-6)
        else:
            layer = GemmaRMSNorm(HIDDEN, eps=1e-6)
        layer.weight.data.copy_(weight.to(layer.weight.dtype))
        layers.append(layer.to(dtype))
    return layers


TOLS = {
    torch.float32: {"rtol": 1e-5, "atol": 1e-5},
    torch.bfloat16: {"rtol": 3.2e-2, "atol": 3.2e-2},
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_gemma_norm_matches_upstream(vllm_env, dtype):
    from spyre_inference import ops

    spyre, upstream = _norms(dtype)
    assert type(spyre) is ops.SpyreGemmaRMSNorm
    assert type(upstream).__name__ == "GemmaRMSNorm"
    g = torch.Generator().manual_seed(1)
    x = (torch.randn(7, HIDDEN, generator=g) * 3).to(dtype)
    residual = torch.randn(7, HIDDEN, generator=g).to(dtype)

    out = spyre(x)
    ref = upstream.forward_native(x)
    assert out.dtype == dtype
    torch.testing.assert_close(out, ref, **TOLS[dtype])

    out, out_res = spyre(x.clone(), residual.clone())
    ref, ref_res = upstream.forward_native(x.clone(), residual.clone())
    torch.testing.assert_close(out, ref, **TOLS[dtype])
    torch.testing.assert_close(out_res, ref_res, **TOLS[dtype])


class _DtypeRecorder(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.dtypes = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self.dtypes.add(t.dtype)
        return out


def test_gemma_norm_never_promotes(vllm_env):
    spyre, upstream = _norms(torch.bfloat16)
    x = torch.randn(3, HIDDEN).to(torch.bfloat16)
    with _DtypeRecorder() as spyre_ops:
        spyre(x, x.clone())
    assert spyre_ops.dtypes == {torch.bfloat16}
    with _DtypeRecorder() as upstream_ops:
        upstream.forward_native(x, x.clone())
    assert torch.float32 in upstream_ops.dtypes  # what the swap avoids
