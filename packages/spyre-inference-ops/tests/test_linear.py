"""The five Spyre linear layers against vLLM's own, built from the same weights.

Weights enter both layers through vLLM's real weight loaders (with the same
shard ids a model's ``load_weights`` uses), then each layer's
``process_weights_after_loading`` runs, as in vLLM's loader. Outputs are
compared on random inputs: float32 within 1e-5 (only the summation order of
``x @ Wt`` and ``F.linear`` differs), bfloat16 within rtol = atol = 1.6e-2
(about one bf16 ulp of an output of order 1).
"""

from __future__ import annotations

import pytest
import torch
from ops_testutil import default_dtype, process_after_loading, tol, upstream_layers

HIDDEN = 96
TOKENS = (1, 7)


def _checkpoint(kind: str, bias: bool, seed: int = 0) -> dict[str, object]:
    """Checkpoint tensors (float32) and how to load them, per layer kind."""
    g = torch.Generator().manual_seed(seed)

    def mat(out_f: int, in_f: int) -> torch.Tensor:
        return torch.randn(out_f, in_f, generator=g) / in_f**0.5

    def vec(n: int) -> torch.Tensor:
        return torch.randn(n, generator=g) * 0.1

    if kind == "qkv":
        head, heads, kv_heads = 32, 4, 2
        shards = {"q": heads * head, "k": kv_heads * head, "v": kv_heads * head}
        weights = [("weight", mat(n, HIDDEN), sid) for sid, n in shards.items()]
        biases = [("bias", vec(n), sid) for sid, n in shards.items()] if bias else []
        return {
            "ctor": ("QKVParallelLinear", (HIDDEN, head, heads, kv_heads), {"bias": bias}),
            "load": weights + biases,
            "in": HIDDEN,
            "out": sum(shards.values()),
        }
    if kind == "merged":
        inter = 160
        loads = [("weight", mat(inter, HIDDEN), 0), ("weight", mat(inter, HIDDEN), 1)]
        if bias:
            loads += [("bias", vec(inter), 0), ("bias", vec(inter), 1)]
        return {
            "ctor": ("MergedColumnParallelLinear", (HIDDEN, [inter, inter]), {"bias": bias}),
            "load": loads,
            "in": HIDDEN,
            "out": 2 * inter,
        }
    in_f, out_f = {"row": (160, HIDDEN), "column": (HIDDEN, 224), "replicated": (HIDDEN, 64)}[kind]
    cls = {
        "row": "RowParallelLinear",
        "column": "ColumnParallelLinear",
        "replicated": "ReplicatedLinear",
    }[kind]
    loads = [("weight", mat(out_f, in_f), None)] + ([("bias", vec(out_f), None)] if bias else [])
    return {"ctor": (cls, (in_f, out_f), {"bias": bias}), "load": loads, "in": in_f, "out": out_f}


def _build(ckpt: dict[str, object], dtype: torch.dtype) -> torch.nn.Module:
    import vllm.model_executor.layers.linear as vllm_linear

    cls_name, args, kwargs = ckpt["ctor"]
    with default_dtype(dtype):
        layer = getattr(vllm_linear, cls_name)(*args, **kwargs)
    for name, tensor, shard in ckpt["load"]:
        param = getattr(layer, name)
        if shard is None:
            param.weight_loader(param, tensor.to(dtype))
        else:
            param.weight_loader(param, tensor.to(dtype), shard)
    process_after_loading(layer)
    return layer


KINDS = ("replicated", "column", "merged", "qkv", "row")
SPYRE_CLASS = {
    "replicated": "SpyreReplicatedLinear",
    "column": "SpyreColumnParallelLinear",
    "merged": "SpyreMergedColumnParallelLinear",
    "qkv": "SpyreQKVParallelLinear",
    "row": "SpyreRowParallelLinear",
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
@pytest.mark.parametrize("kind", KINDS)
def test_spyre_linear_matches_upstream(vllm_env, kind, bias, dtype):
    from spyre_inference import ops

    ckpt = _checkpoint(kind, bias)
    spyre = _build(ckpt, dtype)
    with upstream_layers():
        upstream = _build(ckpt, dtype)

    assert type(spyre) is getattr(ops, SPYRE_CLASS[kind])
    assert type(spyre.quant_method) is ops.SpyreUnquantizedLinearMethod
    assert type(upstream).__name__ == SPYRE_CLASS[kind].removeprefix("Spyre")

    # Stored layout: the weight is the contiguous [in, out] transpose of the
    # loaded [out, in] matrix, bit for bit.
    assert spyre.weight.shape == (ckpt["in"], ckpt["out"])
    assert spyre.weight.is_contiguous()
    assert torch.equal(spyre.weight, upstream.weight.t())

    g = torch.Generator().manual_seed(1)
    for tokens in TOKENS:
        x = torch.randn(tokens, ckpt["in"], generator=g).to(dtype)
        out, out_bias = spyre(x)
        ref, ref_bias = upstream(x)
        assert out.shape == ref.shape == (tokens, ckpt["out"])
        assert out.dtype == ref.dtype == dtype
        torch.testing.assert_close(out, ref, **tol(dtype))
        assert out_bias is ref_bias is None  # skip_bias_add=False: bias applied


def test_qkv_output_stays_fused(vllm_env):
    """One fused GEMM; the model's own split slices q, k, v out of its output."""
    ckpt = _checkpoint("qkv", bias=True)
    spyre = _build(ckpt, torch.float32)
    assert not spyre.gather_output
    x = torch.randn(5, HIDDEN)
    qkv, _ = spyre(x)
    q, k, v = qkv.split([4 * 32, 2 * 32, 2 * 32], dim=-1)
    weights = {sid: t for name, t, sid in ckpt["load"] if name == "weight"}
    biases = {sid: t for name, t, sid in ckpt["load"] if name == "bias"}
    for part, sid in ((q, "q"), (k, "k"), (v, "v")):
        ref = torch.nn.functional.linear(x, weights[sid], biases[sid])
        torch.testing.assert_close(part, ref, rtol=1e-5, atol=1e-5)


def test_skip_bias_add_returns_bias(vllm_env):
    import vllm.model_executor.layers.linear as vllm_linear

    layer = vllm_linear.ColumnParallelLinear(HIDDEN, 64, bias=True, skip_bias_add=True)
    layer.weight.data.normal_()
    layer.bias.data.normal_()
    weight, bias = layer.weight.detach().clone(), layer.bias
    process_after_loading(layer)
    x = torch.randn(3, HIDDEN)
    out, out_bias = layer(x)
    assert out_bias is bias
    torch.testing.assert_close(out, x @ weight.t(), rtol=1e-5, atol=1e-5)


def test_process_weights_twice_keeps_layout(vllm_env):
    """A second post-load pass (weight reload) must not transpose back."""
    ckpt = _checkpoint("column", bias=False)
    layer = _build(ckpt, torch.float32)
    before = layer.weight.detach().clone()
    process_after_loading(layer)
    assert torch.equal(layer.weight, before)


@pytest.mark.parametrize("kind", KINDS)
def test_quantized_layer_keeps_its_method(vllm_env, kind):
    """An AWQ config (constructible on CPU, no kernels) keeps AutoAWQLinearMethod."""
    import vllm.model_executor.layers.linear as vllm_linear
    from vllm.model_executor.layers.quantization import get_quantization_config

    from spyre_inference import ops

    awq = get_quantization_config("awq")(
        weight_bits=4, group_size=32, zero_point=True, lm_head_quantized=False
    )
    ckpt = _checkpoint(kind, bias=False)
    cls_name, args, kwargs = ckpt["ctor"]
    with default_dtype(torch.bfloat16):
        layer = getattr(vllm_linear, cls_name)(*args, **kwargs, quant_config=awq)
    assert type(layer) is getattr(ops, SPYRE_CLASS[kind])
    assert type(layer.quant_method).__name__ == "AutoAWQLinearMethod"
    assert not isinstance(layer.quant_method, ops.SpyreTransposedWeightMethod)
    assert "qweight" in dict(layer.named_parameters())


def test_selection_keeps_unquantized_specialisations(vllm_env):
    """Only the exact UnquantizedLinearMethod is replaced, not vLLM's subclasses of it."""
    import vllm.model_executor.layers.linear as vllm_linear
    from vllm.model_executor.layers.fused_moe.router.gate_linear import _GateLinearMethod

    from spyre_inference.ops import install_transposed_method

    with upstream_layers():
        layer = vllm_linear.ReplicatedLinear(HIDDEN, 8, bias=False)
    assert type(layer.quant_method) is vllm_linear.UnquantizedLinearMethod
    special = _GateLinearMethod()
    layer.quant_method = special
    assert install_transposed_method(layer) is False
    assert layer.quant_method is special
    layer.quant_method = vllm_linear.UnquantizedLinearMethod()
    assert install_transposed_method(layer) is True


@pytest.mark.parametrize(
    ("mode", "kernel"), [("float32", "torch"), ("float32", "auto"), ("model", "auto")]
)
def test_cpu_gemm_dtype(vllm_env, monkeypatch, mode, kernel):
    """SPYRE_CPU_GEMM_DTYPE=float32: a bfloat16 layer computes x @ Wt in float32,
    the float32 product of the bfloat16 values rounded once to bfloat16: on a
    float32 copy of its [in, out] weight (not in the state dict) with
    SPYRE_CPU_GEMM_KERNEL=torch, or through the host kernel on the bfloat16
    weight itself (no copy) where that kernel runs; =model keeps the bfloat16
    matmul and no copy."""
    from spyre_inference.ops.host_gemm import kernel_available
    from spyre_inference.ops.transposed_weight import GEMM_WEIGHT_ATTR, HOST_KERNEL_ATTR
    from spyre_inference.platform import device as dev

    monkeypatch.setenv("SPYRE_CPU_GEMM_DTYPE", mode)
    monkeypatch.setenv("SPYRE_CPU_GEMM_KERNEL", kernel)
    dev.reset_for_tests()
    try:
        use_kernel = mode == "float32" and kernel_available(torch.bfloat16)
        if kernel == "auto" and mode == "float32" and not use_kernel:
            pytest.skip("the host GEMM kernel does not run on this machine")
        ckpt = _checkpoint("merged", bias=False)
        layer = _build(ckpt, torch.bfloat16)
        gemm = getattr(layer, GEMM_WEIGHT_ATTR, None)
        assert GEMM_WEIGHT_ATTR not in layer.state_dict()
        assert getattr(layer, HOST_KERNEL_ATTR, False) is use_kernel
        x = torch.randn(8, ckpt["in"], generator=torch.Generator().manual_seed(2)).bfloat16()
        out, _ = layer(x)
        if mode == "model":
            assert gemm is None
            torch.testing.assert_close(out, x @ layer.weight, **tol(torch.bfloat16))
            return
        ref = (x.double() @ layer.weight.double()).bfloat16()
        if use_kernel:
            assert gemm is None
            # Summation order differs from torch's float32 GEMM; the float32
            # sums agree to ~1e-6 relative, so at most a bfloat16 rounding
            # boundary apart.
            torch.testing.assert_close(out, ref, rtol=8e-3, atol=1e-5)
        else:
            assert gemm is not None and gemm.dtype == torch.float32
            assert torch.equal(gemm, layer.weight.float())
            torch.testing.assert_close(
                out, (x.float() @ layer.weight.float()).bfloat16(), rtol=0, atol=0
            )
    finally:
        monkeypatch.delenv("SPYRE_CPU_GEMM_DTYPE")
        monkeypatch.delenv("SPYRE_CPU_GEMM_KERNEL")
        dev.reset_for_tests()


@pytest.mark.parametrize("pack", ["auto", "off"])
def test_cpu_gemm_pack(vllm_env, monkeypatch, pack):
    """Where matmuls keep the model dtype, SPYRE_CPU_GEMM_PACK=auto runs a bfloat16
    layer through oneDNN on a copy of its [in, out] weight prepacked at load (=off:
    torch's matmul on the weight itself). The product is the float32-accumulated
    one rounded to bfloat16 either way, and a weight rewritten in place (a reload
    in kernel format) reaches the packed copy through refresh_after_weight_update."""
    from spyre_inference.ops import onednn_linear
    from spyre_inference.ops.transposed_weight import PACKED_ATTR
    from spyre_inference.platform import device as dev

    if pack == "auto" and not torch.ops.mkldnn._is_mkldnn_bf16_supported():
        pytest.skip("oneDNN has no bfloat16 matmul on this CPU")
    monkeypatch.setenv("SPYRE_CPU_GEMM_DTYPE", "model")
    monkeypatch.setenv("SPYRE_CPU_GEMM_PACK", pack)
    dev.reset_for_tests()
    try:
        ckpt = _checkpoint("qkv", bias=True)
        layer = _build(ckpt, torch.bfloat16)
        assert getattr(layer, PACKED_ATTR) is (pack == "auto")
        assert onednn_linear.is_packed(layer.weight) is (pack == "auto")
        x = torch.randn(5, ckpt["in"], generator=torch.Generator().manual_seed(3)).bfloat16()

        def reference() -> torch.Tensor:
            return (x.double() @ layer.weight.double() + layer.bias.double()).bfloat16()

        # float32 sums in another order than float64: a bfloat16 rounding apart.
        out, _ = layer(x)
        torch.testing.assert_close(out, reference(), rtol=8e-3, atol=1e-2)
        with torch.no_grad():
            layer.weight.mul_(-0.5)
        layer.quant_method.refresh_after_weight_update(layer)
        out, _ = layer(x)
        torch.testing.assert_close(out, reference(), rtol=8e-3, atol=1e-2)
    finally:
        dev.reset_for_tests()


def test_native_linear_op_routes(vllm_env):
    """The C++ kernel of onednn_linear_t sends a product to oneDNN on the packed copy
    or, up to the configured row count, to the host GEMM kernel on the weight of
    record; each route, forced, gives exactly what that backend gives when called
    directly (oneDNN's own op; the host kernel's float32 product rounded to the
    weight's dtype), and both are the float32-accumulated product to a bf16 ulp."""
    from spyre_inference.ops import host_gemm, onednn_linear

    if not torch.ops.mkldnn._is_mkldnn_bf16_supported():
        pytest.skip("oneDNN has no bfloat16 matmul on this CPU")
    if onednn_linear.kernel() != "native":
        pytest.skip("the C++ linear op cannot be built here")
    if host_gemm.kernel_unavailable_reason(torch.bfloat16):
        pytest.skip("the host GEMM kernel cannot be built here")
    g = torch.Generator().manual_seed(0)
    weight_t = (torch.randn(192, 320, generator=g) / 192**0.5).bfloat16()
    onednn_linear.pack(weight_t)
    packed = torch.ops.mkldnn._reorder_linear_weight(weight_t.t().contiguous(), 1)
    op = torch.ops.spyre_inference.onednn_linear_t.default
    native = torch.ops.spyre_inference_native
    try:
        for rows in (1, 2, 4, 5, 9):
            x = torch.randn(rows, 192, generator=g).bfloat16()
            reference = (x.double() @ weight_t.double()).bfloat16()
            native.set_host_gemm(0, 0)
            via_onednn = op(x, weight_t)
            expected = torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")
            torch.testing.assert_close(via_onednn, expected, rtol=0, atol=0)
            native.set_host_gemm(host_gemm.kernel_address(), 4)
            routed = op(x.unsqueeze(0), weight_t).squeeze(0)
            if rows <= 4:
                expected = host_gemm.host_gemm_w16(x.float(), weight_t).bfloat16()
            torch.testing.assert_close(routed, expected, rtol=0, atol=0)
            for out in (via_onednn, routed):
                torch.testing.assert_close(out, reference, rtol=8e-3, atol=1e-2)
    finally:
        # Back to what this process configured at start-up.
        onednn_linear.kernel.cache_clear()
        onednn_linear.kernel()


@pytest.mark.parametrize(
    ("raw", "rows"), [(None, 2), ("auto", 2), ("AUTO", 2), ("0", 0), ("4", 4), ("-1", None)]
)
def test_host_rows_setting(monkeypatch, raw, rows):
    """SPYRE_CPU_GEMM_HOST_ROWS: `auto` (the default) is the measured crossover, 2 rows;
    a count is taken as given; a negative count is a start-up error naming the setting."""
    from spyre_inference.ops.settings import AUTO_HOST_ROWS, SETTINGS
    from spyre_inference.platform.settings import SettingError

    assert AUTO_HOST_ROWS == 2
    (setting,) = (s for s in SETTINGS if s.name == "SPYRE_CPU_GEMM_HOST_ROWS")
    if raw is None:
        monkeypatch.delenv("SPYRE_CPU_GEMM_HOST_ROWS", raising=False)
    else:
        monkeypatch.setenv("SPYRE_CPU_GEMM_HOST_ROWS", raw)
    if rows is None:
        with pytest.raises(SettingError, match="SPYRE_CPU_GEMM_HOST_ROWS"):
            setting.read()
    else:
        assert setting.read() == rows
