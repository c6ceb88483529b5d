"""Registration through the real entry point, idempotency, and the convert op."""

from __future__ import annotations

import pytest
import torch

EXPECTED_SWAPS = {
    "ReplicatedLinear": "SpyreReplicatedLinear",
    "ColumnParallelLinear": "SpyreColumnParallelLinear",
    "MergedColumnParallelLinear": "SpyreMergedColumnParallelLinear",
    "QKVParallelLinear": "SpyreQKVParallelLinear",
    "RowParallelLinear": "SpyreRowParallelLinear",
    "ParallelLMHead": "SpyreParallelLMHead",
    "LogitsProcessor": "SpyreLogitsProcessor",
    "VocabParallelEmbedding": "SpyreVocabParallelEmbedding",
    "RotaryEmbedding": "SpyreRotaryEmbedding",
    "Llama3RotaryEmbedding": "SpyreLlama3RotaryEmbedding",
    "YaRNScalingRotaryEmbedding": "SpyreYaRNScalingRotaryEmbedding",
    "LinearScalingRotaryEmbedding": "SpyreLinearScalingRotaryEmbedding",
    "NTKScalingRotaryEmbedding": "SpyreNTKScalingRotaryEmbedding",
    "DynamicNTKScalingRotaryEmbedding": "SpyreDynamicNTKScalingRotaryEmbedding",
    "DynamicNTKAlphaRotaryEmbedding": "SpyreDynamicNTKAlphaRotaryEmbedding",
    "Gemma4RotaryEmbedding": "SpyreGemma4RotaryEmbedding",
    "RMSNorm": "SpyreRMSNorm",
    "GemmaRMSNorm": "SpyreGemmaRMSNorm",
    "GateLinear": "SpyreGateLinear",
}
#: Plain nn.Module layers, replaced after the model is built (not in vLLM's registry).
EXPECTED_BUILT_SWAPS = {
    "Phi3LongRoPEScaledRotaryEmbedding": "SpyrePhi3LongRoPEScaledRotaryEmbedding",
}


def _registry_snapshot() -> dict[str, type]:
    from vllm.model_executor.custom_op import op_registry_oot

    return {name: op_registry_oot[name] for name in EXPECTED_SWAPS if name in op_registry_oot}


def test_entry_point_declared():
    from importlib.metadata import entry_points

    (ep,) = [ep for ep in entry_points(group="vllm.general_plugins") if ep.name == "spyre_ops"]
    assert ep.value == "spyre_inference.ops:register_ops"
    from spyre_inference.ops import register_ops

    assert ep.load() is register_ops


def test_vllm_plugin_loader_registers_every_swap(vllm_env):
    from vllm.plugins import load_general_plugins

    load_general_plugins()
    snapshot = _registry_snapshot()
    assert {name: cls.__name__ for name, cls in snapshot.items()} == EXPECTED_SWAPS


def test_register_ops_is_idempotent(vllm_env):
    from spyre_inference.ops import register_all, register_ops

    before = _registry_snapshot()
    register_ops()
    register_ops()
    swaps = register_all()
    assert _registry_snapshot() == before
    assert {name: cls.__name__ for name, cls in swaps.items()} == {
        **EXPECTED_SWAPS,
        **EXPECTED_BUILT_SWAPS,
    }


def test_swap_table_matches_the_declared_swaps(vllm_env):
    """``LAYER_SWAPS`` (the package's one list) names exactly the decorated classes."""
    from spyre_inference.ops import LAYER_SWAPS, register_all

    swaps = register_all()
    assert sorted(cls.__name__ for cls in swaps.values()) == sorted(LAYER_SWAPS)
    for name, module in LAYER_SWAPS.items():
        assert next(c for c in swaps.values() if c.__name__ == name).__module__ == (
            f"spyre_inference.ops.{module}"
        )


def test_register_restores_after_registry_reset(vllm_env):
    """If vLLM's registry loses an entry (a reset), register_ops puts it back."""
    from vllm.model_executor.custom_op import op_registry_oot

    from spyre_inference.ops import register_ops

    saved = op_registry_oot.pop("RotaryEmbedding")
    try:
        register_ops()
        assert op_registry_oot["RotaryEmbedding"] is saved
    finally:
        op_registry_oot["RotaryEmbedding"] = saved


def test_conflicting_swap_is_reported(vllm_env):
    from vllm.model_executor.layers.linear import ColumnParallelLinear

    from spyre_inference.platform.layer_swaps import SwapConflictError, register_swap

    class OtherPluginLinear(ColumnParallelLinear):
        pass

    before = _registry_snapshot()
    with pytest.raises(SwapConflictError, match="SpyreColumnParallelLinear"):
        register_swap(ColumnParallelLinear, OtherPluginLinear)
    assert _registry_snapshot() == before


def test_a_plain_module_cannot_be_a_registry_swap(vllm_env):
    """vLLM's registry never builds a replacement for a plain nn.Module: refused."""
    from vllm.model_executor.layers.rotary_embedding.phi3_long_rope_scaled_rope import (
        Phi3LongRoPEScaledRotaryEmbedding,
    )

    from spyre_inference.platform.layer_swaps import register_swap

    class Other(Phi3LongRoPEScaledRotaryEmbedding):
        pass

    with pytest.raises(TypeError, match="spyre_replaces_built"):
        register_swap(Phi3LongRoPEScaledRotaryEmbedding, Other)


def test_convert_op_registered_and_eager_fast_path(vllm_env):
    from spyre_inference.ops import spyre_convert

    assert hasattr(torch.ops.spyre_inference, "spyre_convert")
    x = torch.randn(3, 4)
    # cpu target: the device is the host; nothing to do, nothing copied.
    assert spyre_convert(x, "device") is x
    assert spyre_convert(x, "host") is x
    y = spyre_convert(x, "host", torch.bfloat16)
    assert y.dtype == torch.bfloat16 and torch.equal(y, x.to(torch.bfloat16))
    with pytest.raises(ValueError, match="direction"):
        spyre_convert(x, "sideways")  # type: ignore[arg-type]


def test_convert_op_is_opaque_in_a_compiled_graph(vllm_env):
    """Under torch.compile the conversion is one custom-op node, no graph break."""
    from torch._dynamo.testing import CompileCounterWithBackend

    from spyre_inference.ops import spyre_convert

    def fn(x):
        return spyre_convert(x * 2, "host", torch.bfloat16) + 1

    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(fn, backend=counter, fullgraph=True, dynamic=False)
    x = torch.randn(5, 8)
    out = compiled(x)
    assert counter.frame_count == 1
    torch.testing.assert_close(out, (x * 2).to(torch.bfloat16) + 1)
    targets = [node.target for gm in counter.graphs for node in gm.graph.nodes]
    op = torch.ops.spyre_inference.spyre_convert
    assert op in targets or op.default in targets
    # The op's own checks (schema, fake kernel, no aliasing) pass.
    torch.library.opcheck(torch.ops.spyre_inference.spyre_convert.default, (x, "host", None))
    torch.library.opcheck(
        torch.ops.spyre_inference.spyre_convert.default, (x, "device", torch.bfloat16)
    )
