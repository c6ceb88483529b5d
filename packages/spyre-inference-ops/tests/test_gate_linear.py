"""The Spyre MoE gate against vLLM's GateLinear: same logits, weight dtype kept.

Upstream asked for float32 router logits returns them in float32; the Spyre
gate returns the same values in the weight dtype (bfloat16 here), so they are
compared at bf16 tolerance (rtol = atol = 1.6e-2).
"""

from __future__ import annotations

import torch
from ops_testutil import BF16_TOL, default_dtype, process_after_loading, upstream_layers

HIDDEN, EXPERTS = 128, 8


def _gates(**kwargs):
    from vllm.model_executor.layers.fused_moe.router.gate_linear import GateLinear

    weight = torch.randn(EXPERTS, HIDDEN, generator=torch.Generator().manual_seed(0))
    weight = (weight / HIDDEN**0.5).to(torch.bfloat16)
    gates = []
    with default_dtype(torch.bfloat16):
        spyre = GateLinear(HIDDEN, EXPERTS, **kwargs)
        with upstream_layers():
            upstream = GateLinear(HIDDEN, EXPERTS, **kwargs)
    for gate in (spyre, upstream):
        gate.weight.weight_loader(gate.weight, weight.to(gate.weight.dtype))
        process_after_loading(gate)
        gates.append(gate)
    return gates


def test_gate_logits_stay_in_weight_dtype(vllm_env):
    from spyre_inference import ops

    spyre, upstream = _gates(out_dtype=torch.float32)
    assert type(spyre) is ops.SpyreGateLinear
    assert spyre.out_dtype is None and spyre.requested_out_dtype == torch.float32
    x = torch.randn(5, HIDDEN).to(torch.bfloat16)
    out, _ = spyre(x)
    ref, _ = upstream(x)
    assert ref.dtype == torch.float32
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), ref, **BF16_TOL)


def test_gate_set_out_dtype_is_recorded_not_applied(vllm_env):
    spyre, _ = _gates()
    spyre.set_out_dtype(torch.float32)
    assert spyre.requested_out_dtype == torch.float32
    out, _ = spyre(torch.randn(2, HIDDEN).to(torch.bfloat16))
    assert out.dtype == torch.bfloat16


def test_gate_force_fp32_compute_keeps_model_dtype(vllm_env):
    spyre, upstream = _gates(force_fp32_compute=True)
    assert upstream.weight.dtype == torch.float32
    assert spyre.weight.dtype == torch.bfloat16
    assert spyre.requested_fp32_compute
