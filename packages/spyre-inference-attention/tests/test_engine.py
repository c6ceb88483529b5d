"""The attention backends inside a real vLLM engine (in-process), against Hugging Face.

* Greedy decoding of tiny random models (built offline by
  ``spyre_inference.testing``) equals transformers' greedy decoding,
  for a Llama with each decoder backend, a Gemma 3 (sliding window on every
  other layer, final logit soft-cap) and a Gemma 2 (sliding window and
  *attention* logit soft-cap, which vLLM's Gemma 3 ignores).
* After warm-up, a served workload of 50 random-length requests compiles
  nothing: Dynamo's graph counter and the attention kernels' own compile count
  stay where warm-up left them.

Only the platform plugin is loaded (``VLLM_PLUGINS=spyre``): the engine runs
vLLM's own layers with this package's attention, which is what this package's
declared dependencies give. The engine runs in-process
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``) so the compile counters are this
process's.
"""

from __future__ import annotations

import gc
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("spyre_inference.testing")

from attn_testutil import reset_settings
from torch._dynamo.utils import counters

from spyre_inference.attention.ops import compiled, host_decode, host_prefill
from spyre_inference.platform import device as placement
from spyre_inference.testing import (
    TEST_PROMPTS,
    VOCAB_SIZE,
    assert_greedy_close,
    hf_greedy_with_logprobs,
)

#: kv-layout setting -> (SPYRE_ATTN_KV_LAYOUT, SPYRE_BATCHED_DECODE)
DECODER_BACKENDS = {
    "token_major": ("token_major", None),
    "token_major_per_seq": ("token_major", "0"),
    "head_major": ("head_major", None),
}
MAX_NEW_TOKENS = 16


@pytest.fixture
def engine_env(monkeypatch):
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    monkeypatch.setenv("VLLM_PLUGINS", "spyre")


@pytest.fixture
def make_llm(engine_env) -> Iterator[Any]:
    from vllm import LLM
    from vllm.distributed import cleanup_dist_env_and_memory

    engines: list[Any] = []

    def factory(model: Path, **kwargs: Any) -> Any:
        kwargs.setdefault("dtype", "float32")
        kwargs.setdefault("block_size", 64)
        kwargs.setdefault("max_model_len", 512)
        kwargs.setdefault("max_num_batched_tokens", 128)
        kwargs.setdefault("max_num_seqs", 16)
        llm = LLM(model=str(model), seed=0, **kwargs)
        engines.append(llm)
        return llm

    yield factory
    for llm in engines:
        llm.llm_engine.engine_core.shutdown()
    engines.clear()
    gc.collect()
    cleanup_dist_env_and_memory()


def greedy(llm: Any, prompts: list[Any], max_tokens: int | list[int]) -> list[list[int]]:
    from vllm import SamplingParams

    if isinstance(max_tokens, int):
        max_tokens = [max_tokens] * len(prompts)
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in max_tokens]
    inputs = [p if isinstance(p, str) else {"prompt_token_ids": p} for p in prompts]
    outputs = llm.generate(inputs, params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outputs]


def check_greedy(model: Path, llm: Any, prompts, *, attn_implementation: str | None = None):
    """Every prompt's greedy tokens equal transformers' (float32, one prompt at a time).

    Both sides compute in float32; a divergence is only accepted at a step
    where the reference's top two log-probabilities are within 1e-3 (a tie that
    reduction order decides), and at most one prompt may take such a tie.
    """
    reference = (
        hf_greedy_with_logprobs(model, prompts, MAX_NEW_TOKENS, torch.float32)
        if attn_implementation is None
        else hf_greedy_eager(model, prompts, MAX_NEW_TOKENS)
    )
    got = greedy(llm, list(prompts), MAX_NEW_TOKENS)
    assert_greedy_close(reference, got, max_logprob_gap=1e-3, min_exact=len(prompts) - 1)


def hf_greedy_eager(model_dir: Path, prompts, max_new_tokens: int):
    """transformers' greedy decoding with its eager attention (the path that soft-caps).

    Gemma 2's attention logit soft-cap is applied by transformers' eager
    attention only (its SDPA path has no soft-cap argument), so the reference
    for a soft-capped model must run eagerly. Same loop as
    ``spyre_inference.testing.hf_greedy_with_logprobs``.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from spyre_inference.testing import GreedyResult

    model = AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=torch.float32, attn_implementation="eager"
    ).eval()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    results = []
    with torch.inference_mode():
        for prompt in prompts:
            ids = list(tokenizer(prompt).input_ids)
            result = GreedyResult(ids, [], [])
            input_ids, past = torch.tensor([ids]), None
            for _ in range(max_new_tokens):
                out = model(input_ids=input_ids, past_key_values=past, use_cache=True)
                past = out.past_key_values
                logprobs = torch.log_softmax(out.logits[0, -1].float(), dim=-1)
                token = int(torch.argmax(logprobs))
                top = torch.topk(logprobs, 5)
                step = {int(i): float(v) for i, v in zip(top.indices, top.values, strict=True)}
                result.token_ids.append(token)
                result.logprobs.append(step)
                input_ids = torch.tensor([[token]])
            results.append(result)
    return results


def use_backend(monkeypatch, name: str) -> None:
    from vllm.v1.attention.selector import _cached_get_attn_backend

    layout, batched = DECODER_BACKENDS[name]
    reset_settings(monkeypatch, SPYRE_ATTN_KV_LAYOUT=layout, SPYRE_BATCHED_DECODE=batched)
    # vLLM caches the platform's backend choice per process (a server never
    # changes layout); engines of one test process that do must forget it, as
    # vLLM's own selection tests do.
    _cached_get_attn_backend.cache_clear()


IMPL_OF = {"token_major": "SpyreAttentionImpl", "head_major": "SpyreHeadMajorAttentionImpl"}


def assert_backend(llm: Any, name: str) -> None:
    """The engine's attention layers run the backend the settings chose."""
    (impls,) = llm.apply_model(
        lambda model: sorted({type(m.impl).__name__ for m in model.modules() if hasattr(m, "impl")})
    )
    assert impls == [IMPL_OF[DECODER_BACKENDS[name][0]]], impls


def long_chunks(backend: str) -> dict[str, Any]:
    """Engine options that let the token-major layouts prefill a whole test prompt at once."""
    return {"max_num_batched_tokens": 512} if backend.startswith("token_major") else {}


def assert_host_prefill_ran(backend: str, calls_before: int) -> None:
    """On the cpu target (with its host kernels built) the token-major layouts' long
    prompts took the host flash kernel."""
    on_host = not placement.is_spyre() and host_decode.kernel_isa() is not None
    if backend.startswith("token_major") and on_host:
        assert host_prefill.calls() > calls_before


# ---- greedy equals Hugging Face ------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("backend", sorted(DECODER_BACKENDS))
def test_llama_greedy_matches_hf(backend, tiny_llama, make_llm, monkeypatch):
    """All ten test prompts (5 to 354 tokens: chunked prefills, block crossings).

    The token-major layouts take whole prompts in one chunk, so on the cpu target
    the longer ones run on the host flash kernel and the shorter ones as host-kernel
    rows; the head-major layout chunks them onto its graphs."""
    use_backend(monkeypatch, backend)
    llm = make_llm(tiny_llama, enforce_eager=True, **long_chunks(backend))
    assert_backend(llm, backend)
    calls = host_prefill.calls()
    check_greedy(tiny_llama, llm, TEST_PROMPTS)
    assert_host_prefill_ran(backend, calls)


@pytest.mark.slow
def test_long_prompt_in_chunks_matches_hf(tiny_llama, make_llm, monkeypatch):
    """A 600-odd-token prompt prefilled in 256-token chunks: on the cpu target the two
    full chunks take the host flash kernel (context 0, then 256: its own keys causally,
    the first chunk's fully), the rest joins the decode kernel's rows."""
    use_backend(monkeypatch, "token_major")
    prompt = " ".join(TEST_PROMPTS[-4:])
    llm = make_llm(tiny_llama, enforce_eager=True, max_model_len=1000, max_num_batched_tokens=256)
    assert 512 < len(llm.get_tokenizer()(prompt).input_ids) < 1000 - MAX_NEW_TOKENS
    calls = host_prefill.calls()
    check_greedy(tiny_llama, llm, [prompt])
    assert_host_prefill_ran("token_major", calls)


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["token_major", "head_major"])
def test_gemma3_sliding_window_matches_hf(backend, tiny_gemma3, make_llm, monkeypatch):
    """Window 48 on every other layer (shorter than most prompts), final soft-cap."""
    use_backend(monkeypatch, backend)
    llm = make_llm(tiny_gemma3, enforce_eager=True, **long_chunks(backend))
    assert_backend(llm, backend)
    calls = host_prefill.calls()
    check_greedy(tiny_gemma3, llm, TEST_PROMPTS)
    assert_host_prefill_ran(backend, calls)


@pytest.mark.slow
@pytest.mark.parametrize("kernel", ["plugin", "torch"])
@pytest.mark.parametrize("model", ["llama", "gemma3"])
def test_each_prefill_kernel_serves_bf16_close_to_hf(
    kernel, model, tiny_llama, tiny_gemma3, make_llm, monkeypatch
):
    """bfloat16 prompts of 256 to ~700 tokens, each prefilled whole
    through each of the cpu target's prefill kernels (``SPYRE_CPU_PREFILL_KERNEL``,
    the plugin's on CPUs with AVX-512 BF16 only): the forced one ran, greedy close to
    float32 transformers (divergence only where the reference's top-2 are near-tied,
    the other side's token in its top-5). The two kernels round differently (the
    plugin's P V takes bf16 pairs in another order), so in bfloat16 they may part at
    such a tie; each is held to the float32 reference. Gemma 3 brings its window of 48."""
    path = tiny_llama if model == "llama" else tiny_gemma3
    use_backend(monkeypatch, "token_major")
    reset_settings(monkeypatch, SPYRE_CPU_PREFILL_KERNEL=kernel)
    host_prefill.reset_for_tests()
    if kernel == "plugin" and host_prefill.kernel_unavailable_reason():
        pytest.skip(
            f"the prefill kernel cannot run here: {host_prefill.kernel_unavailable_reason()}"
        )
    prompts = [TEST_PROMPTS[-1], " ".join(TEST_PROMPTS[-3:]), " ".join(TEST_PROMPTS[4:9])]
    llm = make_llm(
        path,
        dtype="bfloat16",
        enforce_eager=True,
        max_model_len=1024,
        max_num_batched_tokens=1024,
    )
    lengths = [len(llm.get_tokenizer()(p).input_ids) for p in prompts]
    assert min(lengths) >= 256 and max(lengths) < 1024 - MAX_NEW_TOKENS, lengths
    before = host_prefill.kernel_calls(), host_prefill.calls()
    got = greedy(llm, prompts, MAX_NEW_TOKENS)
    if not placement.is_spyre() and host_decode.kernel_isa() is not None:
        assert host_prefill.calls() > before[1]
        ran = host_prefill.kernel_calls() > before[0]
        assert ran == (kernel == "plugin")
    reference = hf_greedy_with_logprobs(path, prompts, MAX_NEW_TOKENS, "float32", num_logprobs=5)
    assert_greedy_close(reference, got, max_logprob_gap=0.2, min_exact=len(prompts) - 1)
    host_prefill.reset_for_tests()


@pytest.fixture(scope="session")
def tiny_gemma2_softcap(tmp_path_factory) -> Path:
    """Gemma 2: attention logit soft-cap 3.0 (near the score scale, so it matters),
    window 48 on every other layer, final soft-cap 10; the testing module's
    initialisation and tokenizer."""
    from transformers import Gemma2Config, Gemma2ForCausalLM

    from spyre_inference.testing import BOS_TOKEN_ID, EOS_TOKEN_ID, PAD_TOKEN_ID
    from spyre_inference.testing.models import TinyModelKind, init_weights_
    from spyre_inference.testing.tokenizer import save_tokenizer

    out = tmp_path_factory.mktemp("tiny-gemma2-softcap")
    config = Gemma2Config(
        vocab_size=VOCAB_SIZE,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        max_position_embeddings=1024,
        query_pre_attn_scalar=64,
        sliding_window=48,
        layer_types=["sliding_attention", "full_attention"],
        attn_logit_softcapping=3.0,
        final_logit_softcapping=10.0,
        tie_word_embeddings=True,
        bos_token_id=BOS_TOKEN_ID,
        eos_token_id=EOS_TOKEN_ID,
        pad_token_id=PAD_TOKEN_ID,
    )
    config.architectures = ["Gemma2ForCausalLM"]
    torch.manual_seed(0)
    model = Gemma2ForCausalLM(config)
    spec = TinyModelKind("gemma2", "Gemma2ForCausalLM", "decoder", {})
    init_weights_(model, config, spec, seed=0)
    model.to(torch.bfloat16).save_pretrained(out)
    save_tokenizer(out, "decoder", model_max_length=1024)
    return out


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["token_major", "head_major"])
def test_gemma2_attention_softcap_and_window_match_hf(
    backend, tiny_gemma2_softcap, make_llm, monkeypatch
):
    use_backend(monkeypatch, backend)
    llm = make_llm(tiny_gemma2_softcap, enforce_eager=True)
    assert_backend(llm, backend)
    check_greedy(tiny_gemma2_softcap, llm, TEST_PROMPTS, attn_implementation="eager")
    # The soft-cap matters for this model: transformers' SDPA path, which
    # ignores it, decodes differently.
    capped = [r.token_ids for r in hf_greedy_eager(tiny_gemma2_softcap, TEST_PROMPTS, 16)]
    uncapped = [
        r.token_ids
        for r in hf_greedy_with_logprobs(tiny_gemma2_softcap, TEST_PROMPTS, 16, torch.float32)
    ]
    assert capped != uncapped


# ---- no compile after warm-up -----------------------------------------------------------


def random_workload(n: int, max_model_len: int, seed: int = 0):
    """``n`` requests of random prompt length (token ids) and random output length."""
    rng = random.Random(seed)
    prompts, max_tokens = [], []
    for _ in range(n):
        length = rng.randint(1, max_model_len - 60)
        prompts.append([rng.randrange(10, VOCAB_SIZE) for _ in range(length)])
        max_tokens.append(rng.randint(1, min(48, max_model_len - length)))
    return prompts, max_tokens


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["token_major", "head_major"])
def test_served_workload_after_warm_up_compiles_nothing(backend, tiny_llama, make_llm, monkeypatch):
    use_backend(monkeypatch, backend)
    max_model_len = 256
    recorded_before = compiled.stats.recorded
    llm = make_llm(
        tiny_llama,
        enforce_eager=False,
        max_model_len=max_model_len,
        max_num_batched_tokens=64,
        max_num_seqs=8,
    )
    assert_backend(llm, backend)
    # Warm-up recorded the attention kernels (or found them from an earlier
    # engine of this process with the same shapes).
    assert compiled.stats.recorded >= recorded_before
    graphs = counters["stats"]["unique_graphs"]
    lazy = compiled.stats.lazy

    # The compiled engine is still exact (prompts that fit max_model_len).
    prompts = [p for p in TEST_PROMPTS if len(p) < 400][:6]
    check_greedy(tiny_llama, llm, prompts)

    requests, max_tokens = random_workload(50, max_model_len)
    outputs = greedy(llm, requests, max_tokens)
    assert [len(o) for o in outputs] == max_tokens

    after = counters["stats"]["unique_graphs"]
    print(
        f"[{backend}] Dynamo graphs after warm-up {graphs}, after 6 + 50 requests {after}; "
        f"attention variants recorded {compiled.stats.recorded}, lazy {compiled.stats.lazy - lazy}"
    )
    assert after == graphs, "a request compiled a new graph"
    assert compiled.stats.lazy == lazy, "an attention kernel variant compiled after warm-up"
