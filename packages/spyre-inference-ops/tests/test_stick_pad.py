"""Head-dim and MLP stick padding: exact, checked against the unpadded upstream layers.

The padded layers are built the way vLLM builds them once the platform has
widened the config (``head_dim`` 32 -> 64, ``intermediate_size`` 344 -> 384)
and are loaded with the *original* checkpoint tensors through vLLM's loaders;
the reference is vLLM's own layers at the original sizes. Attention itself is
plain PyTorch SDPA (the reference both sides share), with the scale the
attention backend gets from ``stick_pad.attention_scale``. float32 results
agree within 1e-5 (only summation order differs: the pad entries are exact
zeros); bfloat16 within rtol = atol = 1.6e-2.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.nn.functional as F
from ops_testutil import default_dtype, process_after_loading, tol, upstream_layers

from spyre_inference.platform.stick_pad import (
    PLAN_KEY,
    DimPad,
    StickPadPlan,
    attention_scale,
    plan_for,
)

HIDDEN, HEADS, KV_HEADS, HEAD, PADDED_HEAD = 128, 4, 2, 32, 64
INTER, PADDED_INTER = 344, 384
MAX_POS = 128


@contextlib.contextmanager
def padded_config(plan: StickPadPlan):
    """A VllmConfig carrying ``plan`` as the platform records it, made current."""
    from vllm.config import VllmConfig, set_current_vllm_config

    config = VllmConfig(additional_config={PLAN_KEY: plan.to_dict()})
    with set_current_vllm_config(config):
        yield config


PLAN = StickPadPlan(DimPad(HEAD, PADDED_HEAD), DimPad(INTER, PADDED_INTER))


# ---- the pure pieces ---------------------------------------------------------


def test_plan_for():
    assert plan_for(64, 512) == StickPadPlan()
    assert plan_for(32, 344) == PLAN
    assert plan_for(80, None).head_dim == DimPad(80, 128)
    assert plan_for(None, 344, tp_size=4).intermediate_size == DimPad(344, 512)
    with pytest.raises(ValueError, match="odd"):
        plan_for(33, None)
    assert StickPadPlan.from_dict(PLAN.to_dict()) == PLAN
    pinned = StickPadPlan(DimPad(80, 128), rotary_dims=(20,))
    assert StickPadPlan.from_dict(pinned.to_dict()) == pinned


def test_pad_heads_layout():
    from spyre_inference.ops.stick_pad_load import pad_heads, pad_tail

    # Two heads of 4 ([a0 a1 | a2 a3], [b0 b1 | b2 b3]) padded to 8.
    t = torch.arange(1.0, 9.0)
    out = pad_heads(t, 0, DimPad(4, 8))
    expected = [1, 2, 0, 0, 3, 4, 0, 0, 5, 6, 0, 0, 7, 8, 0, 0]
    assert out.tolist() == expected
    m = torch.randn(3, 8)
    out = pad_heads(m, 1, DimPad(4, 8))
    assert out.shape == (3, 16)
    assert torch.equal(out[:, [0, 1, 4, 5, 8, 9, 12, 13]], m)
    assert not out[:, [2, 3, 6, 7, 10, 11, 14, 15]].any()
    assert torch.equal(pad_tail(m, 1, 10)[:, :8], m) and not pad_tail(m, 1, 10)[:, 8:].any()
    with pytest.raises(ValueError, match="multiple"):
        pad_heads(torch.zeros(6), 0, DimPad(4, 8))


def test_attention_scale():
    plan = StickPadPlan(DimPad(HEAD, PADDED_HEAD))
    # Llama/Qwen: scale derived from the (widened) head_dim -> original scale.
    assert attention_scale(PADDED_HEAD, PADDED_HEAD**-0.5, plan) == pytest.approx(HEAD**-0.5)
    # Granite attention_multiplier, Gemma query_pre_attn_scalar: kept.
    assert attention_scale(PADDED_HEAD, 0.2, plan) == 0.2
    # A layer that was not widened (another head size): kept.
    assert attention_scale(128, 128**-0.5, plan) == 128**-0.5
    assert attention_scale(PADDED_HEAD, PADDED_HEAD**-0.5, None) == PADDED_HEAD**-0.5


# ---- attention block: QKV + RoPE + attention + O --------------------------


def _attention_checkpoint(seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(HEADS * HEAD, HIDDEN, generator=g) / HIDDEN**0.5
    k = torch.randn(KV_HEADS * HEAD, HIDDEN, generator=g) / HIDDEN**0.5
    v = torch.randn(KV_HEADS * HEAD, HIDDEN, generator=g) / HIDDEN**0.5
    bias = {
        s: torch.randn(n, generator=g) * 0.1
        for s, n in (("q", q.shape[0]), ("k", k.shape[0]), ("v", v.shape[0]))
    }
    o = torch.randn(HIDDEN, HEADS * HEAD, generator=g) / (HEADS * HEAD) ** 0.5
    return {"q": q, "k": k, "v": v}, bias, o


def _attention_block(head, dtype, ckpt, *, fused=False, neox=True, rotary_dim=None):
    from vllm.model_executor.layers.linear import QKVParallelLinear, RowParallelLinear
    from vllm.model_executor.layers.rotary_embedding import RotaryEmbedding

    weights, biases, o = ckpt
    with default_dtype(dtype):
        qkv = QKVParallelLinear(HIDDEN, head, HEADS, KV_HEADS, bias=True)
        o_proj = RowParallelLinear(HEADS * head, HIDDEN, bias=False)
        rope = RotaryEmbedding(head, rotary_dim or head, MAX_POS, 10000.0, neox, dtype)
    if fused:
        fused_w = torch.cat([weights[s] for s in "qkv"]).to(dtype)
        qkv.weight.weight_loader(qkv.weight, fused_w)
        qkv.bias.weight_loader(qkv.bias, torch.cat([biases[s] for s in "qkv"]).to(dtype))
    else:
        for sid in "qkv":
            qkv.weight.weight_loader(qkv.weight, weights[sid].to(dtype), sid)
            qkv.bias.weight_loader(qkv.bias, biases[sid].to(dtype), sid)
    o_proj.weight.weight_loader(o_proj.weight, o.to(dtype))
    process_after_loading(qkv)
    process_after_loading(o_proj)
    return qkv, rope, o_proj


def _run_attention(block, head, scale, x, positions):
    qkv, rope, o_proj = block
    out, _ = qkv(x)
    q, k, v = out.split([HEADS * head, KV_HEADS * head, KV_HEADS * head], dim=-1)
    q, k = rope(positions, q, k)
    tokens = x.shape[0]
    qh = q.view(tokens, HEADS, head).transpose(0, 1)
    kh = k.view(tokens, KV_HEADS, head).transpose(0, 1).repeat_interleave(HEADS // KV_HEADS, 0)
    vh = v.view(tokens, KV_HEADS, head).transpose(0, 1).repeat_interleave(HEADS // KV_HEADS, 0)
    attn = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, scale=scale)
    attn = attn.transpose(0, 1).reshape(tokens, HEADS * head)
    result, _ = o_proj(attn)
    return result, q


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize(
    ("fused", "neox"),
    [(False, True), (True, True), (False, False)],
    ids=["per_shard", "fused_ckpt", "interleaved_rope"],
)
def test_padded_attention_block_matches_unpadded(vllm_env, dtype, fused, neox):
    """Interleaved (GPT-J-style) RoPE takes the pair form, which maps its pairs
    into the padded ``[x1, 0, x2, 0]`` head; neox takes the 2x2 form."""
    ckpt = _attention_checkpoint()
    with upstream_layers():
        reference = _attention_block(HEAD, dtype, ckpt, neox=neox)
    with padded_config(PLAN) as config:
        padded = _attention_block(PADDED_HEAD, dtype, ckpt, fused=fused, neox=neox)
        # What the attention backend will be handed: the model's own scale,
        # derived from the widened head_dim.
        scale = attention_scale(PADDED_HEAD, PADDED_HEAD**-0.5)
    assert config.additional_config[PLAN_KEY] == {
        "head_dim": [32, 64],
        "intermediate_size": [344, 384],
    }
    assert scale == pytest.approx(HEAD**-0.5)

    qkv, rope, o_proj = padded
    assert qkv.weight.shape == (HIDDEN, (HEADS + 2 * KV_HEADS) * PADDED_HEAD)
    assert o_proj.weight.shape == (HEADS * PADDED_HEAD, HIDDEN)
    if neox:
        assert rope.rotation_cache.shape == (MAX_POS, 2, 2, PADDED_HEAD // 2)
        # Pad frequencies are the identity rotation.
        assert torch.equal(
            rope.rotation_cache[:, 0, 0, HEAD // 2 :], torch.ones(MAX_POS, 16, dtype=dtype)
        )
        assert not rope.rotation_cache[:, 0, 1, HEAD // 2 :].any()
    else:
        assert rope.rotation_cache.shape == (MAX_POS, 2, PADDED_HEAD)
        pads = torch.cat((torch.arange(16, 32), torch.arange(48, 64)))
        assert torch.equal(rope.rotation_cache[:, 0, pads], torch.ones(MAX_POS, 32, dtype=dtype))
        assert not rope.rotation_cache[:, 1, pads].any()

    g = torch.Generator().manual_seed(1)
    x = torch.randn(11, HIDDEN, generator=g).to(dtype)
    positions = torch.arange(11) + 3
    out, q_padded = _run_attention(padded, PADDED_HEAD, scale, x, positions)
    ref, q_ref = _run_attention(reference, HEAD, HEAD**-0.5, x, positions)
    torch.testing.assert_close(out, ref, **tol(dtype))
    # Rotated Q: the original entries equal the unpadded rotation, the pads stay zero.
    q_padded = q_padded.view(11, HEADS, 2, PADDED_HEAD // 2)
    torch.testing.assert_close(q_padded[..., : HEAD // 2].reshape(11, -1), q_ref, **tol(dtype))
    assert not q_padded[..., HEAD // 2 :].any()


@pytest.mark.parametrize("neox", [True, False], ids=["neox", "interleaved"])
@pytest.mark.parametrize("rotary_dim", [8, 24], ids=["quarter", "three_quarters"])
def test_partial_rope_on_a_padded_head_matches_unpadded(vllm_env, rotary_dim, neox):
    """StableLM-3B / Phi-2 in small: a leading share of each head rotates, the head is
    widened 32 -> 64 and the platform pins the share to the checkpoint's width
    (``rope_dim``). Three quarters puts pairs in both halves of the padded layout."""
    dtype = torch.float32
    ckpt = _attention_checkpoint()
    with upstream_layers():
        reference = _attention_block(HEAD, dtype, ckpt, neox=neox, rotary_dim=rotary_dim)
    plan = StickPadPlan(DimPad(HEAD, PADDED_HEAD), rotary_dims=(rotary_dim,))
    with padded_config(plan):
        padded = _attention_block(PADDED_HEAD, dtype, ckpt, neox=neox, rotary_dim=rotary_dim)
    rope = padded[1]
    assert rope.partner is not None and rope.rotation_cache.shape == (MAX_POS, 2, PADDED_HEAD)
    g = torch.Generator().manual_seed(2)
    x = torch.randn(11, HIDDEN, generator=g)
    positions = torch.arange(11) + 5
    out, q_padded = _run_attention(padded, PADDED_HEAD, HEAD**-0.5, x, positions)
    ref, q_ref = _run_attention(reference, HEAD, HEAD**-0.5, x, positions)
    torch.testing.assert_close(out, ref, **tol(dtype))
    q_padded = q_padded.view(11, HEADS, 2, PADDED_HEAD // 2)
    torch.testing.assert_close(q_padded[..., : HEAD // 2].reshape(11, -1), q_ref, **tol(dtype))
    assert not q_padded[..., HEAD // 2 :].any()


def test_partial_width_derived_from_the_padded_head_raises_at_construction(vllm_env):
    """A width the config did not pin (a model class multiplying its own factor with
    the widened head) would rotate the wrong entries: refused."""
    from vllm.model_executor.layers.rotary_embedding import RotaryEmbedding

    plan = StickPadPlan(DimPad(HEAD, PADDED_HEAD), rotary_dims=(8,))
    with padded_config(plan), pytest.raises(NotImplementedError, match="derived the width"):
        RotaryEmbedding(PADDED_HEAD, PADDED_HEAD // 2, MAX_POS, 10000.0, True, torch.float32)


def test_padded_llama3_rope_keeps_original_frequencies(vllm_env):
    from vllm.model_executor.layers.rotary_embedding import Llama3RotaryEmbedding

    args = (10000.0, True, torch.float32, 8.0, 1.0, 4.0, 32)
    with upstream_layers():
        reference = Llama3RotaryEmbedding(HEAD, HEAD, MAX_POS, *args)
    with padded_config(PLAN):
        padded = Llama3RotaryEmbedding(PADDED_HEAD, PADDED_HEAD, MAX_POS, *args)
    cos, sin = reference.cos_sin_cache.chunk(2, -1)
    assert torch.equal(padded.rotation_cache[:, 0, 0, : HEAD // 2], cos)
    assert torch.equal(padded.rotation_cache[:, 1, 0, : HEAD // 2], sin)


# ---- MLP: gate/up + SiluAndMul + down ----------------------------------------


def _mlp(inter, dtype, gate, up, down, *, fused=False):
    from vllm.model_executor.layers.linear import MergedColumnParallelLinear, RowParallelLinear

    with default_dtype(dtype):
        gate_up = MergedColumnParallelLinear(HIDDEN, [inter, inter], bias=False)
        down_proj = RowParallelLinear(inter, HIDDEN, bias=False)
    if fused:
        gate_up.weight.weight_loader(gate_up.weight, torch.cat([gate, up]).to(dtype))
    else:
        gate_up.weight.weight_loader(gate_up.weight, gate.to(dtype), 0)
        gate_up.weight.weight_loader(gate_up.weight, up.to(dtype), 1)
    down_proj.weight.weight_loader(down_proj.weight, down.to(dtype))
    process_after_loading(gate_up)
    process_after_loading(down_proj)
    return gate_up, down_proj


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("fused", [False, True], ids=["per_shard", "fused_ckpt"])
def test_padded_mlp_matches_unpadded(vllm_env, dtype, fused):
    from vllm.model_executor.layers.activation import SiluAndMul

    g = torch.Generator().manual_seed(2)
    gate = torch.randn(INTER, HIDDEN, generator=g) / HIDDEN**0.5
    up = torch.randn(INTER, HIDDEN, generator=g) / HIDDEN**0.5
    down = torch.randn(HIDDEN, INTER, generator=g) / INTER**0.5
    with upstream_layers():
        reference = _mlp(INTER, dtype, gate, up, down)
    with padded_config(PLAN):
        padded = _mlp(PADDED_INTER, dtype, gate, up, down, fused=fused)
    assert padded[0].weight.shape == (HIDDEN, 2 * PADDED_INTER)
    assert padded[1].weight.shape == (PADDED_INTER, HIDDEN)

    x = torch.randn(9, HIDDEN, generator=g).to(dtype)
    results = []
    for gate_up, down_proj in (padded, reference):
        h, _ = gate_up(x)
        act = SiluAndMul.forward_native(h)
        out, _ = down_proj(act)
        results.append((act, out))
    (act_p, out_p), (act_r, out_r) = results
    assert act_p.shape[-1] == PADDED_INTER
    assert not act_p[:, INTER:].any()  # silu(0) * 0
    torch.testing.assert_close(act_p[:, :INTER], act_r, **tol(dtype))
    torch.testing.assert_close(out_p, out_r, **tol(dtype))


def test_plain_mlp_fc1_tail_padding(vllm_env):
    from vllm.model_executor.layers.linear import ColumnParallelLinear

    g = torch.Generator().manual_seed(3)
    w, b = torch.randn(INTER, HIDDEN, generator=g), torch.randn(INTER, generator=g)
    with padded_config(PLAN):
        fc1 = ColumnParallelLinear(HIDDEN, PADDED_INTER, bias=True)
    fc1.weight.weight_loader(fc1.weight, w)
    fc1.bias.weight_loader(fc1.bias, b)
    process_after_loading(fc1)
    x = torch.randn(4, HIDDEN, generator=g)
    out, _ = fc1(x)
    torch.testing.assert_close(out[:, :INTER], F.linear(x, w, b), rtol=1e-5, atol=1e-5)
    assert not out[:, INTER:].any()


def test_row_padding_ambiguity_is_an_error(vllm_env):
    from vllm.model_executor.layers.linear import RowParallelLinear

    plan = StickPadPlan(DimPad(32, 64), DimPad(32, 64))
    with padded_config(plan):
        row = RowParallelLinear(64, HIDDEN, bias=False, prefix="model.layers.0.x_proj")
    with pytest.raises(NotImplementedError, match=r"x_proj.*both"):
        row.weight.weight_loader(row.weight, torch.zeros(HIDDEN, 32))


def test_quantized_qkv_with_head_padding_is_refused(vllm_env):
    from vllm.model_executor.layers.linear import QKVParallelLinear
    from vllm.model_executor.layers.quantization import get_quantization_config

    awq = get_quantization_config("awq")(
        weight_bits=4, group_size=32, zero_point=True, lm_head_quantized=False
    )
    with padded_config(PLAN), default_dtype(torch.bfloat16):
        with pytest.raises(NotImplementedError, match="unquantized weights only"):
            QKVParallelLinear(HIDDEN, PADDED_HEAD, HEADS, KV_HEADS, quant_config=awq, prefix="qkv")
