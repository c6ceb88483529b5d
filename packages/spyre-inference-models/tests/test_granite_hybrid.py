"""Granite 4 hybrid (GraniteMoeHybrid): Mamba2 mixers and attention in one stack.

Tiny random ``GraniteMoeHybridForCausalLM`` checkpoints (layers mamba,
attention, mamba, mamba; Mamba2 heads of 32 and a state of 48, off the
64-element stick, so their states are stored stick-padded; Granite's
multipliers) run through vLLM's own model class
with the plugin's Mamba2 mixer (``spyre_inference.models.mamba2``) and the
hybrid KV-cache manager, compiled per block as served, in float32. The
reference is transformers' own model (its PyTorch Mamba2 path), greedy, one
prompt at a time.

Prompts run from 5 to 354 tokens against ``max_num_batched_tokens=128``: the
long ones are prefilled in several chunks, so the conv and SSM states carried
from one chunk to the next are exercised, and cross several KV blocks.
"""

from __future__ import annotations

import pytest
import torch

from spyre_inference.models import mamba2
from spyre_inference.testing import TEST_PROMPTS, hf_greedy, runner_of

MAX_TOKENS = 12
PROMPTS = (*TEST_PROMPTS[:4], TEST_PROMPTS[7], TEST_PROMPTS[9])


def _mixer_classes(model):
    return sorted({type(m).__name__ for m in model.modules() if "Mamba" in type(m).__name__})


def _state_shapes(model):
    return [
        [list(t.shape) for t in m.kv_cache]
        for m in model.modules()
        if type(m).__name__ == "SpyreMambaMixer2"
    ]


def assert_states_in_whole_sticks(llm) -> None:
    """The tiny model's head 32 / state 48 / conv width 608 are stored padded to sticks."""
    (shapes,) = llm.apply_model(_state_shapes)
    assert shapes
    for conv, ssm in shapes:
        assert ssm[-2:] == [64, 64], ssm
        assert max(conv[1:]) == 640, conv  # 2 * 256 + 2 * 48 = 608 channels, padded


def _check_greedy(llm, model_dir) -> None:
    from vllm import SamplingParams

    want = hf_greedy(model_dir, PROMPTS, MAX_TOKENS, "float32")
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    got = [list(o.outputs[0].token_ids) for o in llm.generate(list(PROMPTS), params)]
    mismatches = {i: (w, g) for i, (g, w) in enumerate(zip(got, want, strict=True)) if g != w}
    assert not mismatches


@pytest.mark.parametrize("experts", [0, 4], ids=["dense", "moe"])
def test_granite_hybrid_greedy_equals_hf(tiny_model_factory, make_llm, experts) -> None:
    model = tiny_model_factory("granitemoehybrid", num_local_experts=experts)
    assert max(len(p) for p in PROMPTS) > 300
    llm = make_llm(model, dtype="float32", enable_prefix_caching=False)
    (classes,) = llm.apply_model(_mixer_classes)
    assert "SpyreMambaMixer2" in classes
    # The model class reports the padded state shapes to vLLM's page planning.
    (model_class,) = llm.apply_model(lambda m: type(m).__name__)
    assert model_class == "SpyreGraniteMoeHybridForCausalLM"
    assert_states_in_whole_sticks(llm)
    _check_greedy(llm, model)


@pytest.mark.parametrize("experts", [0, 4], ids=["dense", "moe"])
def test_granite_hybrid_graphs_do_not_grow_with_depth(tiny_model_factory, inproc_llm, experts):
    """The same block graphs for 4 and 8 layers (one per layer class and position variant)."""
    seen = {}
    for layers in (4, 8):
        types = ["linear_attention", "full_attention", "linear_attention", "linear_attention"]
        model = tiny_model_factory(
            "granitemoehybrid",
            num_hidden_layers=layers,
            layer_types=(types * 2)[:layers],
            num_local_experts=experts,
        )
        llm = inproc_llm(model, buckets="16,64", enable_prefix_caching=False)
        runner = runner_of(llm)
        report = runner.compile_report
        assert report.granularity == "block"
        assert sum(report.classes.values()) == layers
        seen[layers] = dict(runner.warm_up_stats.graphs)
        assert runner.warm_up_stats.depth_independent
        llm.llm_engine.engine_core.shutdown()
    assert seen[4] == seen[8], seen


def test_scan_matches_the_step_by_step_recurrence() -> None:
    """The chunked scan (prefill) = the recurrent step (decode) applied token by token.

    Both are this package's; the engine tests above hold them to transformers.
    Here the two forms are held to each other across chunk borders, with a
    carried initial state and odd sizes (5 heads of 24, state 20, 2 groups).
    """
    gen = torch.Generator().manual_seed(0)
    T, H, P, G, N = 150, 4, 24, 2, 20
    x = torch.randn(T, H, P, generator=gen)
    dt = torch.nn.functional.softplus(torch.randn(T, H, generator=gen))
    A = -torch.rand(H, generator=gen) - 0.2
    B, C = torch.randn(T, G, N, generator=gen), torch.randn(T, G, N, generator=gen)
    D = torch.randn(H, generator=gen)
    state0 = torch.randn(H, P, N, generator=gen)
    y, final = mamba2.ssd_scan(x, dt, A, B, C, D, state0, chunk=64)
    state = state0.unsqueeze(0)
    steps = []
    for t in range(T):
        yt, state = mamba2.ssd_step(
            state, x[t : t + 1], dt[t : t + 1], A, B[t : t + 1], C[t : t + 1], D
        )
        steps.append(yt[0])
    torch.testing.assert_close(y, torch.stack(steps), rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(final, state[0], rtol=1e-4, atol=1e-4)


def test_conv_carries_its_state_across_chunks() -> None:
    """A sequence convolved whole = convolved in two pieces with the state carried."""
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(37, 10, generator=gen)
    w, b = torch.randn(10, 4, generator=gen), torch.randn(10, generator=gen)
    whole, state = mamba2.causal_conv1d(x, w, b, None)
    first, mid = mamba2.causal_conv1d(x[:2], w, b, None)  # shorter than the window
    second, end = mamba2.causal_conv1d(x[2:], w, b, mid)
    torch.testing.assert_close(torch.cat((first, second)), whole)
    torch.testing.assert_close(end, state)
    # And against torch's own conv1d with zero history, SiLU after.
    ref = torch.nn.functional.conv1d(
        torch.nn.functional.pad(x.t(), (3, 0)).unsqueeze(0), w.unsqueeze(1), b, groups=10
    )[0].t()
    torch.testing.assert_close(whole, torch.nn.functional.silu(ref))
