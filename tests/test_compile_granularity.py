"""Compilation granularity end to end: per-block graphs, buckets, warm-up, results.

The engine runs in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``) so the
test can read torch's own compile counters and Dynamo's cache next to the
model. What "compiled block artifacts" means here, precisely: the graphs Dynamo
holds for a block class's ``forward`` after warm-up (each one went through
Inductor once, compiled or loaded from its cache), divided by the number of
num_tokens buckets warm-up ran. torch's global ``unique_graphs`` counter (every
graph Dynamo compiled in the process, attention kernels included) is checked
alongside it.

Dynamo keeps compiled graphs per code object for the whole process, so each
engine here starts from ``torch._dynamo.reset()``: without it a second engine of
the same architecture would find the first one's graphs.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file
from vllm import LLM, SamplingParams

from spyre_inference.testing import (
    TEST_PROMPTS,
    compiled_graphs,
    hf_greedy,
    inductor_calls,
    runner_of,
)

MAX_TOKENS = 16


def _shutdown(llm: LLM) -> None:
    llm.llm_engine.engine_core.shutdown()


# ---- Must show 1: compiled block artifacts independent of depth -------------


def test_llama_blocks_compile_twice_per_bucket_at_any_depth(tiny_model_factory, inproc_llm) -> None:
    """Layer 0 (``residual is None``) and every other layer: 2 graphs per bucket, 2 or 6 layers."""
    seen = {}
    for layers in (2, 6):
        model = tiny_model_factory("llama", num_hidden_layers=layers)
        llm = inproc_llm(model, buckets="16,64")
        runner = runner_of(llm)
        report = runner.compile_report
        assert report.granularity == "block"
        assert report.stacks == ("model.layers",)
        assert report.classes == {"LlamaDecoderLayer": layers}
        buckets = runner.token_buckets.sizes
        assert buckets == (16, 64)
        assert report.artifacts() == {"LlamaDecoderLayer": 2 * len(buckets)}
        assert runner.warm_up_stats.graphs == {"LlamaDecoderLayer": 2 * len(buckets)}
        assert runner.warm_up_stats.depth_independent
        seen[layers] = (compiled_graphs(), inductor_calls())
        _shutdown(llm)
    # torch's own counters: the whole start-up (blocks, attention kernels,
    # helpers) compiled exactly as many graphs for 6 layers as for 2.
    assert seen[2] == seen[6], seen


#: Gemma 3 4B/12B/27B: global (full-attention) layers use linearly scaled RoPE,
#: local (sliding-window) layers plain RoPE with another theta.
GEMMA3_ROPE = {
    "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
    "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1000000.0},
}


def test_gemma3_alternating_stack_compiles_three_per_bucket_at_any_depth(
    tiny_model_factory, inproc_llm
) -> None:
    """Sliding-window and full-attention layers alternate: 3 block graphs per bucket.

    Dynamo's recompile reasons name the three variants: layer 0 (``residual is
    None``, a sliding layer), the other sliding layers, and the full-attention
    layers, whose RoPE module is another class (linear scaling). The sliding
    window itself lives inside the opaque attention op and costs no graph.
    The count is the same at 4 and 8 layers.
    """
    seen = {}
    for layers in (4, 8):
        model = tiny_model_factory("gemma3", num_hidden_layers=layers, rope_parameters=GEMMA3_ROPE)
        llm = inproc_llm(model, buckets="64")
        runner = runner_of(llm)
        report = runner.compile_report
        assert report.granularity == "block"
        assert report.classes == {"Gemma3DecoderLayer": layers}
        assert report.artifacts() == {"Gemma3DecoderLayer": 3}
        assert runner.warm_up_stats.depth_independent
        seen[layers] = (compiled_graphs(), inductor_calls())
        _shutdown(llm)
    assert seen[4] == seen[8], seen


def test_encoder_stack_compiles_one_graph_per_bucket(tiny_model_factory, inproc_llm) -> None:
    """BERT's ``encoder.layer`` is found structurally; its layers have one code path."""
    model = tiny_model_factory("bert", num_hidden_layers=4)
    llm = inproc_llm(
        model, buckets="64,128", runner="pooling", max_model_len=256, max_num_batched_tokens=256
    )
    runner = runner_of(llm)
    report = runner.compile_report
    assert report.stacks == ("model.encoder.layer",)
    assert report.classes == {"BertLayer": 4}
    assert report.artifacts() == {"BertLayer": len(runner.token_buckets.sizes)}
    graphs = compiled_graphs()
    out = llm.embed(["hello world", "a man is eating food " * 20, "x"], use_tqdm=False)
    assert all(len(o.outputs.embedding) == 256 for o in out)
    assert compiled_graphs() == graphs


# ---- Must show 3: nothing compiles after warm-up ----------------------------


def _random_workload(llm: LLM) -> list[Any]:
    """50 random requests: lengths across every bucket, sampling and logprobs options.

    Greedy and seeded requests (most of them) are reproducible; the rest
    sample from the engine's global generator.
    """
    rng = random.Random(1234)
    vocab = llm.get_tokenizer().vocab_size
    prompts, params = [], []
    for i in range(50):
        length = rng.choice([rng.randint(1, 8), rng.randint(9, 100), rng.randint(100, 400)])
        prompts.append({"prompt_token_ids": [rng.randrange(3, vocab) for _ in range(length)]})
        params.append(
            SamplingParams(
                max_tokens=rng.randint(1, 24),
                temperature=rng.choice([0.0, 0.7, 1.0]),
                top_p=rng.choice([1.0, 0.9]),
                top_k=rng.choice([-1, 20]),
                logprobs=rng.choice([None, None, 0, 3]),
                prompt_logprobs=rng.choice([None, None, None, 2]),
                seed=rng.choice([None, 1000 + i, 2000 + i]),
                ignore_eos=True,
            )
        )
    # Some alone (steps of 1..8 tokens, single decodes), the rest in one batch
    # (chunked prefill mixed with decodes across every bucket).
    outs = [llm.generate([prompts[i]], [params[i]], use_tqdm=False)[0] for i in range(10)]
    outs += llm.generate(prompts[10:], params[10:], use_tqdm=False)
    assert all(
        len(o.outputs[0].token_ids) == p.max_tokens for o, p in zip(outs, params, strict=True)
    )
    return [
        (o.outputs[0].token_ids, o.outputs[0].cumulative_logprob)
        for o, p in zip(outs, params, strict=True)
        if p.temperature == 0.0 or p.seed is not None
    ]


def test_random_requests_after_warm_up_compile_nothing(
    tiny_model_factory, inproc_llm, monkeypatch
) -> None:
    # Full guard checks on every call, so any step that needs a graph warm-up
    # did not compile shows up in the counters below.
    monkeypatch.setenv("SPYRE_SETTLED_GUARDS", "0")
    model = tiny_model_factory("llama", num_hidden_layers=2)
    llm = inproc_llm(model)  # the cpu target's default buckets for a 64-token budget
    runner = runner_of(llm)
    assert runner.token_buckets.sizes == (1, 2, 4, 8, 16, 32, 64)
    graphs, inductor = compiled_graphs(), inductor_calls()
    blocks = runner.compile_report.artifacts()
    assert graphs > 0

    _random_workload(llm)

    assert compiled_graphs() == graphs, "a graph compiled after warm-up"
    assert inductor_calls() == inductor, "Inductor ran after warm-up"
    assert runner.compile_report.artifacts() == blocks
    assert not runner._wrapper.guards.settled


def test_settled_guards_serve_the_same_results(tiny_model_factory, inproc_llm, monkeypatch) -> None:
    """Steps with only Dynamo's differentiating guards pick the same graphs as full checks.

    Same random workload on two engines, settled guards off then on: every
    reproducible request (greedy or seeded) gets the same tokens and
    cumulative logprob. The second engine really ran lean: served calls saw
    the stance, every bucket settled after one full-guard step, warm-up did
    not settle any, and its settled steps called the blocks' graphs directly
    (``direct_block_calls``), each block and bucket resolved once.
    """
    from spyre_inference.platform import direct_block_calls

    model = tiny_model_factory("llama", num_hidden_layers=2)
    results = {}
    for mode in ("0", "1"):
        monkeypatch.setenv("SPYRE_SETTLED_GUARDS", mode)
        llm = inproc_llm(model)
        runner = runner_of(llm)
        guards = runner._wrapper.guards
        assert not guards.settled, "warm-up must run with full guards"
        stances: list[bool] = []
        lean_buckets: set[int] = set()

        def seen(_module, _args, kwargs, stances=stances, lean_buckets=lean_buckets):
            stances.append(torch._dynamo.eval_frame._is_skip_guard_eval_unsafe_stance())
            if stances[-1]:
                lean_buckets.add(int(kwargs["positions"].shape[-1]))

        hook = runner.model.register_forward_pre_hook(seen, with_kwargs=True)
        graphs = compiled_graphs()
        direct = direct_block_calls.stats().snapshot()
        results[mode] = _random_workload(llm)
        hook.remove()
        assert compiled_graphs() == graphs
        direct_now = direct_block_calls.stats().snapshot()
        if mode == "0":
            assert not guards.settled and not any(stances)
            assert direct_now == direct
        else:
            assert direct_now["refused"] == direct["refused"]
            # Two blocks, one signature each per bucket; every lean step calls both.
            assert direct_now["resolved"] - direct["resolved"] == 2 * len(lean_buckets)
            assert direct_now["direct"] - direct["direct"] == 2 * stances.count(True)
            assert guards.settled == set(runner.token_buckets.sizes)
            # One full-guard step per bucket, every later step lean.
            assert stances.count(False) == len(runner.token_buckets.sizes)
            assert stances.count(True) > 50
        _shutdown(llm)
    assert results["0"] == results["1"]


# ---- Must show 2 and 4: weights and greedy results --------------------------


@pytest.fixture(scope="module")
def llama6(tiny_model_factory) -> Path:
    return tiny_model_factory("llama", num_hidden_layers=6)


@pytest.fixture(scope="module")
def hf_reference(llama6) -> list[list[int]]:
    return hf_greedy(llama6, TEST_PROMPTS, MAX_TOKENS, "float32")


def _greedy(llm: LLM) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    return [list(o.outputs[0].token_ids) for o in llm.generate(list(TEST_PROMPTS), params)]


@pytest.fixture(scope="module")
def eager_reference(llama6, tmp_path_factory) -> dict[str, Any]:
    """Greedy tokens, parameter names and saved weights of the eager engine."""
    import vllm.envs as vllm_envs

    mp = pytest.MonkeyPatch()
    mp.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    vllm_envs.disable_envs_cache()
    try:
        llm = LLM(
            model=str(llama6),
            dtype="float32",
            enforce_eager=True,
            max_model_len=512,
            max_num_seqs=8,
            max_num_batched_tokens=128,
        )
        model = runner_of(llm).model
        path = tmp_path_factory.mktemp("eager-weights") / "model.safetensors"
        save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(path))
        ref = {
            "tokens": _greedy(llm),
            "names": [n for n, _ in model.named_parameters()],
            "weights": path,
        }
        _shutdown(llm)
    finally:
        mp.undo()
        vllm_envs.disable_envs_cache()
    return ref


@pytest.mark.parametrize("granularity", ["block", "model"])
def test_greedy_compiled_equals_eager_and_hf(
    granularity, llama6, hf_reference, eager_reference, inproc_llm
) -> None:
    llm = inproc_llm(llama6, buckets="16,64", granularity=granularity, max_num_batched_tokens=128)
    runner = runner_of(llm)
    report = runner.compile_report
    assert report.granularity == granularity
    if granularity == "model":
        # One whole-model graph per bucket, none per block.
        assert report.artifacts() == {"LlamaForCausalLM": len(runner.token_buckets.sizes)}
        assert all(b._compiled_call_impl is None for b in runner.model.model.layers)
    got = _greedy(llm)
    assert eager_reference["tokens"] == hf_reference
    mismatches = [i for i, (g, w) in enumerate(zip(got, hf_reference, strict=True)) if g != w]
    assert not mismatches, {i: (hf_reference[i], got[i]) for i in mismatches}


def test_compiled_weights_keep_names_and_round_trip(
    llama6, eager_reference, inproc_llm, tmp_path
) -> None:
    """In-place compile: same parameter names as eager; weights save and load back strictly."""
    llm = inproc_llm(llama6, buckets="16,64", max_num_batched_tokens=128)
    model = runner_of(llm).model
    names = [n for n, _ in model.named_parameters()]
    assert names == eager_reference["names"]
    assert not any("_orig_mod" in n for n in model.state_dict())
    assert all(type(b).__name__ == "LlamaDecoderLayer" for b in model.model.layers)

    # Save from the compiled model: identical to what the eager model saved.
    path = tmp_path / "compiled.safetensors"
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(path))
    saved, eager = load_file(str(path)), load_file(str(eager_reference["weights"]))
    assert saved.keys() == eager.keys()
    for key in saved:
        torch.testing.assert_close(saved[key], eager[key], rtol=0, atol=0, msg=key)

    # Scramble the live weights, then reload the saved file strictly: the
    # compiled graphs read the restored parameters (they are graph inputs, not
    # baked constants) and generate the eager tokens again, without compiling.
    graphs = compiled_graphs()
    # The engine built its weights as inference tensors: edit them in that mode.
    with torch.inference_mode():
        for p in model.parameters():
            p.mul_(-1.0)
        missing, unexpected = model.load_state_dict(saved, strict=True)
    assert not missing and not unexpected
    assert _greedy(llm) == eager_reference["tokens"]
    assert compiled_graphs() == graphs
