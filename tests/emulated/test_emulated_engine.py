"""The spyre target's code path end to end on the emulated card (float16).

Engines run in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``) so the
tests can look at where the runner put things. Small buckets keep compiles
short. The three card-path bugs of issue 22 each have a check here:

1. the KV cache lives on the device (it was allocated on the host);
2. the LM head gets device hidden states (the runner slices them on the host):
   the step would raise on the emulated card otherwise, and every transfer the
   device made went through the core's conversion home;
3. warm-up builds its inputs on the device, so serving compiles nothing new
   (the variant keys hold the device type).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from vllm import LLM, SamplingParams

from spyre_inference.platform import device as dev
from spyre_inference.platform import emulated_card
from spyre_inference.testing import TEST_PROMPTS, assert_greedy_close
from spyre_inference.testing.hf import hf_greedy_with_logprobs, hf_input_embeddings

MAX_TOKENS = 12
ENGINE = {
    "dtype": "float16",
    "max_model_len": 512,
    "max_num_seqs": 4,
    "max_num_batched_tokens": 128,
    # The emulated card's memory is host RAM: a small KV cache is enough here.
    "kv_cache_memory_bytes": 64 << 20,
}


@pytest.fixture
def in_process(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    monkeypatch.setenv("SPYRE_NUM_TOKENS_BUCKETS", "32,128")


def _runner(llm: LLM):
    return llm.llm_engine.model_executor.driver_worker.worker.model_runner


def _shutdown(llm: LLM) -> None:
    llm.llm_engine.engine_core.shutdown()


def _serve_greedy(llm: LLM, prompts: list[str]) -> tuple[list[list[int]], tuple[int, int]]:
    """Greedy tokens of ``prompts``, and the (h2d, d2h) transfers the device counted.

    Checks the card-path rules every served step keeps: nothing compiles while
    serving (bug 3), and the device saw exactly the transfers
    ``spyre_inference.platform.device`` made, none behind its back (bug 2 and
    the conversion home).
    """
    from spyre_inference.attention.ops import compiled

    lazy = compiled.stats.lazy
    before = emulated_card.transfer_counts()
    home = (dev.transfers.h2d, dev.transfers.d2h)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    got = [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params)]
    assert compiled.stats.lazy == lazy
    after = emulated_card.transfer_counts()
    moved = (after[0] - before[0], after[1] - before[1])
    assert moved == (dev.transfers.h2d - home[0], dev.transfers.d2h - home[1])
    return got, moved


def _greedy_and_shut_down(llm: LLM, inputs: list) -> list[list[int]]:
    """Greedy tokens of ``inputs`` (prompts or ``{"prompt_embeds": ...}``); the engine is
    shut down whatever happens."""
    try:
        params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
        return [list(o.outputs[0].token_ids) for o in llm.generate(inputs, params)]
    finally:
        _shutdown(llm)


#: Config overrides per kind: GLM-4 with 80-wide heads puts interleaved, partial
#: (half the head, pinned to 40 entries) and stick-padded (80 -> 128) RoPE on the card.
GREEDY_OVERRIDES = {"glm4": {"head_dim": 80}}


@pytest.mark.parametrize("kind", ["llama", "granite", "gemma2", "glm4"])
def test_greedy_close_to_transformers_float16(kind, tiny_model_factory, in_process) -> None:
    """Gemma 2 too: vLLM refuses it in float16, the card path lifts that refusal
    (platform.float16_models) since the card has no other dtype."""
    model = tiny_model_factory(kind, **GREEDY_OVERRIDES.get(kind, {}))
    prompts = list(TEST_PROMPTS[:4])
    llm = LLM(str(model), **ENGINE)
    try:
        runner = _runner(llm)
        # Bug 1: every layer's KV cache is on the card.
        caches = [t for t in runner.kv_caches if isinstance(t, torch.Tensor)]
        assert caches and all(t.device.type == "spyre" for t in caches)
        assert all(p.device.type == "spyre" for p in runner.model.parameters())
        got, moved = _serve_greedy(llm, prompts)
        assert moved[0] > 0 and moved[1] > 0
    finally:
        _shutdown(llm)
    reference = hf_greedy_with_logprobs(model, prompts, MAX_TOKENS, torch.float16)
    exact = assert_greedy_close(reference, got)
    print(f"\n{kind} emulated float16: {exact}/{len(prompts)} prompts identical to HF float16")


def _rotary_caches(model: torch.nn.Module) -> list[tuple[str, str, torch.dtype]]:
    return [
        (type(m).__name__, m.rotation_cache.device.type, m.rotation_cache.dtype)
        for m in model.modules()
        if hasattr(m, "rotation_cache")
    ]


def test_phi3_longrope_greedy_close_to_transformers_float16(tiny_model_factory, in_process):
    """Longrope on the card path: vLLM's class is a plain nn.Module, replaced after the
    model is built and before it moves to the card; the rotation cache (long factors,
    max_model_len 512 over an original 64) is on the device, head 32 stick-padded."""
    half = 16
    model = tiny_model_factory(
        "phi3",
        rope_parameters={
            "rope_type": "longrope",
            "rope_theta": 10000.0,
            "short_factor": [1.0 + 0.05 * i for i in range(half)],
            "long_factor": [1.0 + 1.5 * i for i in range(half)],
            "original_max_position_embeddings": 64,
        },
        original_max_position_embeddings=64,
        max_position_embeddings=1024,
    )
    # Over 64 tokens each, so transformers also takes the long factors.
    prompts = list(TEST_PROMPTS[6:9])
    llm = LLM(str(model), **ENGINE)
    try:
        (caches,) = llm.apply_model(_rotary_caches)
        assert caches and set(caches) == {
            ("SpyrePhi3LongRoPEScaledRotaryEmbedding", "spyre", torch.float16)
        }, caches
        got, _ = _serve_greedy(llm, prompts)
    finally:
        _shutdown(llm)
    reference = hf_greedy_with_logprobs(model, prompts, MAX_TOKENS, torch.float16)
    exact = assert_greedy_close(reference, got)
    print(f"\nphi3 longrope emulated float16: {exact}/{len(prompts)} identical to HF float16")


def test_lora_is_refused_on_the_card_path_before_the_engine(tiny_llama) -> None:
    """vLLM's punica kernels are host code: the card path refuses LoRA by name."""
    with pytest.raises(ValueError, match=r"LoRA \(--enable-lora / enable_lora=True\)"):
        LLM(str(tiny_llama), enable_lora=True, max_lora_rank=8, **ENGINE)


def test_quantization_is_refused_on_the_card_path_before_the_engine(tiny_llama) -> None:
    """The 8-bit kernels have run on the cpu target only: the card path refuses them."""
    with pytest.raises(ValueError, match=r"quantization='fp8' .*not been verified on the Spyre"):
        LLM(str(tiny_llama), quantization="fp8", **ENGINE)


def test_prompt_embeds_close_to_transformers_float16(tiny_llama, in_process) -> None:
    """``--enable-prompt-embeds`` on the card path: vLLM embeds the token-id rows
    itself with host ids into its ``inputs_embeds`` buffer (it failed on the
    emulated card: a host index into the device table); embeddings and token-id
    prompts share a batch."""
    prompts = list(TEST_PROMPTS[:4])
    embeds = hf_input_embeddings(tiny_llama, prompts[:2], torch.float16)
    llm = LLM(str(tiny_llama), enable_prompt_embeds=True, **ENGINE)
    got = _greedy_and_shut_down(llm, [{"prompt_embeds": e} for e in embeds] + prompts[2:])
    reference = hf_greedy_with_logprobs(tiny_llama, prompts, MAX_TOKENS, torch.float16)
    exact = assert_greedy_close(reference, got)
    print(f"\nprompt embeds, emulated float16: {exact}/{len(prompts)} identical to HF float16")


def test_weight_offloading_is_refused_on_the_card_path_before_the_engine(tiny_llama) -> None:
    """The card's graphs read weights from its memory: ``--cpu-offload-gb`` would be
    silently ignored (the plugin builds on the host, so vLLM's offloader moves nothing)."""
    with pytest.raises(ValueError, match=r"--cpu-offload-gb 1 is not supported on a Spyre card"):
        LLM(str(tiny_llama), cpu_offload_gb=1, **ENGINE)


def _mamba_states(model: torch.nn.Module) -> list[tuple[str, str, torch.dtype, int]]:
    """(mixer class, device, dtype, last dimension) of every Mamba state tensor."""
    return [
        (type(m).__name__, t.device.type, t.dtype, t.shape[-1])
        for m in model.modules()
        if "Mamba" in type(m).__name__ and isinstance(getattr(m, "kv_cache", None), tuple)
        for t in m.kv_cache
    ]


@pytest.mark.parametrize("experts", [0, 4], ids=["dense", "moe"])
def test_granite_hybrid_greedy_close_to_transformers_float16(
    tiny_model_factory, in_process, experts
) -> None:
    """Granite 4 hybrid on the card path: the Mamba2 states live on the device
    (vLLM's hybrid KV-cache pages, allocated there like the KV cache), the mixer
    computes in float16 with no bool or integer compute on the device, and long
    prompts are prefilled in chunks that carry the conv and SSM states."""
    model = tiny_model_factory("granitemoehybrid", num_local_experts=experts)
    prompts = [*TEST_PROMPTS[:3], TEST_PROMPTS[7], TEST_PROMPTS[9]]
    llm = LLM(str(model), enable_prefix_caching=False, **ENGINE)
    try:
        runner = _runner(llm)
        (states,) = llm.apply_model(_mamba_states)
        # Every mixer holds its conv and SSM states as float16 views of the
        # card's KV-cache allocation, in whole 64-element sticks (the tiny
        # model's 608 conv channels and state of 48 are padded to 640 and 64).
        assert len(states) == 2 * 3, states
        assert set(states) == {
            ("SpyreMambaMixer2", "spyre", torch.float16, 640),
            ("SpyreMambaMixer2", "spyre", torch.float16, 64),
        }, states
        caches = [t for t in runner.kv_caches if t.dtype.is_floating_point]
        assert caches and all(t.device.type == "spyre" for t in caches)
        got, _ = _serve_greedy(llm, prompts)
    finally:
        _shutdown(llm)
    assert max(len(p) for p in prompts) > 2 * ENGINE["max_num_batched_tokens"]
    reference = hf_greedy_with_logprobs(model, prompts, MAX_TOKENS, torch.float32)
    exact = assert_greedy_close(reference, got)
    print(f"\nGranite hybrid emulated float16: {exact}/{len(prompts)} identical to HF float32")


def test_int8_vocab_is_refused_on_the_card_path_before_the_engine(tiny_llama, monkeypatch) -> None:
    """SPYRE_CPU_INT8_VOCAB is a cpu-target option (INT8 GEMMs, integer tensors)."""
    from spyre_inference.platform import settings

    monkeypatch.setenv("SPYRE_CPU_INT8_VOCAB", "1")
    settings.reset_cache()
    try:
        with pytest.raises(ValueError, match=r"SPYRE_CPU_INT8_VOCAB=1 is a cpu-target option"):
            LLM(str(tiny_llama), **ENGINE)
    finally:
        monkeypatch.delenv("SPYRE_CPU_INT8_VOCAB")
        settings.reset_cache()


def test_pipeline_parallel_is_refused_on_the_card_path_before_the_engine(tiny_llama) -> None:
    """Stages exchange activations by send/recv, verified over gloo on the cpu target
    only: the card path refuses pipeline parallelism by name."""
    with pytest.raises(ValueError, match=r"pipeline_parallel_size=2 has not been verified"):
        LLM(str(tiny_llama), pipeline_parallel_size=2, **ENGINE)


def test_minilm_embeddings_match_sentence_transformers(in_process, monkeypatch) -> None:
    sys.path.insert(0, str(Path(__file__).parents[2] / "packages/spyre-inference-models/tests"))
    from minilm_data import SENTENCES, minilm_path, reference_embeddings

    from spyre_inference.attention.ops import compiled

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("SPYRE_ATTN_NUM_SEQS_BUCKETS", "1,8")
    path = minilm_path()
    sentences = SENTENCES[:8]
    want = reference_embeddings(path, sentences)
    llm = LLM(path, dtype="float16", max_model_len=128, max_num_batched_tokens=128)
    try:
        lazy = compiled.stats.lazy
        got = torch.tensor([o.outputs.embedding for o in llm.embed(sentences)])
        assert compiled.stats.lazy == lazy  # bug 3: encoder warm-up on the device
    finally:
        _shutdown(llm)
    cosines = torch.nn.functional.cosine_similarity(got, want, dim=-1)
    print(f"\nMiniLM emulated float16: min cosine {cosines.min():.6f}")
    assert cosines.min() >= 0.99, cosines.tolist()


def test_tp2_greedy_close_to_transformers_float16(tiny_llama, monkeypatch) -> None:
    """TP=2 (mp executor, two worker processes): block graphs all-reduce in-graph (the
    emulated compiler runs gloo on host views), the embedding's all-reduce and the
    logits all-gather run eagerly through the communicator's spyreccl stand-in."""
    monkeypatch.setenv("SPYRE_NUM_TOKENS_BUCKETS", "32,128")
    prompts = list(TEST_PROMPTS[:4])
    llm = LLM(str(tiny_llama), tensor_parallel_size=2, **ENGINE)
    got = _greedy_and_shut_down(llm, prompts)
    reference = hf_greedy_with_logprobs(tiny_llama, prompts, MAX_TOKENS, torch.float16)
    exact = assert_greedy_close(reference, got)
    print(f"\nTP=2 emulated float16: {exact}/{len(prompts)} prompts identical to HF float16")


def _worker_target(worker) -> str:
    from spyre_inference.platform import device as worker_dev

    return worker_dev.target().value


def test_tp2_under_ray_runs_the_card_path_in_every_worker(tiny_llama, monkeypatch) -> None:
    """TP=2 under vLLM's Ray executor, on a cluster started without any ``SPYRE_*``
    variable (as an operator starts a node): each worker decides its device target
    when it first resolves the platform, before vLLM hands it the engine's
    environment, so the executor passes ``SPYRE_*`` in Ray's runtime env. Without
    that the workers would run the cpu target under an emulated-card engine."""
    pytest.importorskip("ray")
    from tests.ray_cluster import client_env, ray_cluster

    monkeypatch.setenv("SPYRE_NUM_TOKENS_BUCKETS", "32,128")
    monkeypatch.setenv("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
    prompts = list(TEST_PROMPTS[:4])
    with ray_cluster(units=2) as address:
        for name, value in client_env(address).items():
            monkeypatch.setenv(name, value)
        llm = LLM(
            str(tiny_llama), tensor_parallel_size=2, distributed_executor_backend="ray", **ENGINE
        )
        try:
            targets = llm.collective_rpc(_worker_target)
            params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
            got = [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params)]
        finally:
            _shutdown(llm)
    assert targets == ["emulated", "emulated"], targets
    reference = hf_greedy_with_logprobs(tiny_llama, prompts, MAX_TOKENS, torch.float16)
    exact = assert_greedy_close(reference, got)
    print(f"\nTP=2 under Ray, emulated float16: {exact}/{len(prompts)} prompts identical to HF")
