"""vLLM's sampling parameters through the plugin (sampling runs on the host).

References: Hugging Face transformers (greedy log-softmax, prompt log-softmax,
``generate`` with its repetition-penalty, sequence-bias and minimum-length
processors, and presence/frequency penalties written out over its logits),
and vLLM's documented semantics where there is no reference implementation
(seeds, filters, stop strings, ``n``), checked against the engine's own raw
log-probabilities, which the logprob test ties to transformers.

Tolerance for log-probabilities: 1e-4 (absolute, nats). Both sides compute in
float32 from the same weights, so only reduction order differs; a wrong mask,
position or page moves log-probabilities by whole units.

Checks share generate calls where they can (one request per variant, run as
one batch) to keep the engine steps few.
"""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Any

import pytest
from vllm import SamplingParams
from vllm.exceptions import VLLMValidationError

from spyre_inference.testing import EOS_TOKEN_ID, TEST_PROMPTS, hf_greedy_with_logprobs
from tests.features.hf_ref import HFModel
from tests.features.util import STEP_BUDGET, greedy_params, token_ids

LOGPROB_TOL = 1e-4
PROMPTS = list(TEST_PROMPTS[1:4])
TOKENS = 16


@pytest.fixture(scope="module")
def hf(feature_model: Path) -> HFModel:
    return HFModel.load(feature_model)


@pytest.fixture(scope="module")
def greedy(main_llm) -> list[list[int]]:
    return token_ids(main_llm.generate(PROMPTS, greedy_params(TOKENS)))


def sampling(**kwargs: Any) -> SamplingParams:
    kwargs.setdefault("max_tokens", TOKENS)
    kwargs.setdefault("ignore_eos", True)
    return SamplingParams(**kwargs)


# ---- seeds and filters -----------------------------------------------------------


@pytest.mark.feature("seed", "temperature", "top_k", "top_p", "min_p")
def test_seeded_sampling_is_reproducible(main_llm, greedy) -> None:
    """A request's seed fixes its samples, whatever else is in the batch."""
    knobs = dict(temperature=0.9, top_k=50, top_p=0.9, min_p=0.02)
    seeded = [sampling(seed=seed, **knobs) for seed in (1, 2, 3)]
    first = token_ids(main_llm.generate(PROMPTS, seeded))
    assert first != greedy, "sampling at temperature 0.9 picked the greedy tokens throughout"
    # Again, now each with a different batch: the first request next to a
    # different seed of itself.
    again = main_llm.generate(PROMPTS + PROMPTS[:1], [*seeded, sampling(seed=4, **knobs)])
    assert token_ids(again[:3]) == first
    assert token_ids(again[3:]) != first[:1]


@pytest.mark.feature("seed", "chunked_prefill")
def test_seed_holds_when_its_prompt_is_chunked_next_to_decodes(main_llm) -> None:
    """A seeded request samples the same tokens alone as when its prompt's chunks
    share steps with another request's decodes.

    Alone, every chunk but the last fills a whole step, so nothing is sampled
    until the prompt is in. Next to a decoding request each step is sampled,
    and the draw made for the unfinished prompt's row is thrown away: the
    runner must undo it on the request's generator (vLLM rewinds a CUDA
    generator's offset; host generators have none).
    """
    long_prompt = TEST_PROMPTS[-1]
    assert len(main_llm.get_tokenizer().encode(long_prompt)) > 2 * STEP_BUDGET
    seeded = sampling(seed=21, temperature=0.9)
    alone = token_ids(main_llm.generate([long_prompt], [seeded]))
    # The short request goes first, so it is decoding by the time the long
    # prompt's chunks are scheduled, however the two reach the engine.
    short = sampling(seed=22, temperature=0.9, max_tokens=4 * TOKENS)
    _, mixed = main_llm.generate([TEST_PROMPTS[0], long_prompt], [short, seeded])
    assert token_ids([mixed]) == alone


#: The plugin's host sampler (main engine) and vLLM's own (reference engine).
SAMPLERS = pytest.mark.parametrize("engine", ["main_llm", "reference_llm"])


@SAMPLERS
@pytest.mark.feature("top_k", "top_p", "min_p", "temperature")
def test_filters_that_keep_one_token_are_greedy(engine, greedy, request) -> None:
    llm = request.getfixturevalue(engine)
    variants = [{}, {"top_k": 1}, {"top_p": 1e-6}, {"min_p": 1.0}]
    params = [sampling(temperature=1.0, seed=11, **v) for v in variants]
    unfiltered, *filtered = token_ids(llm.generate(PROMPTS[:1] * len(params), params))
    assert unfiltered != greedy[0]  # so the filters have something to remove
    for knob, got in zip(variants[1:], filtered, strict=True):
        assert got == greedy[0], knob


def _steps(output: Any) -> list[tuple[int, dict[int, Any]]]:
    """(sampled token, its step's logprob dict) for every generated position."""
    completion = output.outputs[0]
    return list(zip(completion.token_ids, completion.logprobs, strict=True))


@SAMPLERS
@pytest.mark.feature("top_k", "top_p", "min_p")
def test_filters_sample_within_their_bounds(engine, request) -> None:
    """top-k: among the k most likely; top-p: the most likely tokens until their
    mass reaches p; min-p: at least p times the top token's probability. Raw
    log-probabilities (vLLM's default) are the unfiltered distribution, equal to
    the sampling one at temperature 1."""
    top_k, top_p, min_p = 5, 0.5, 0.1
    params = [
        sampling(temperature=1.0, seed=3, logprobs=20, top_k=top_k),
        sampling(temperature=1.0, seed=5, logprobs=20, top_p=top_p),
        sampling(temperature=1.0, seed=7, logprobs=20, min_p=min_p),
    ]
    k_out, p_out, m_out = request.getfixturevalue(engine).generate(PROMPTS, params)

    ranks = [step[token].rank for token, step in _steps(k_out)]
    assert max(ranks) <= top_k and len(set(ranks)) > 1, ranks
    for token, step in _steps(p_out):
        rank = step[token].rank
        above = sum(math.exp(lp.logprob) for lp in step.values() if lp.rank < rank)
        assert above < top_p + 1e-5, (token, rank, above)
    for token, step in _steps(m_out):
        top = max(lp.logprob for lp in step.values())
        assert step[token].logprob >= math.log(min_p) + top - 1e-5, (token, step)


# ---- log-probabilities -------------------------------------------------------------


@pytest.mark.feature("logprobs")
def test_greedy_logprobs_match_hf_log_softmax(main_llm, feature_model, record_property) -> None:
    outputs = main_llm.generate(PROMPTS, greedy_params(TOKENS, logprobs=5))
    reference = hf_greedy_with_logprobs(feature_model, PROMPTS, TOKENS, "float32", num_logprobs=5)
    worst = 0.0
    for out, ref in zip(outputs, reference, strict=True):
        completion = out.outputs[0]
        assert list(completion.token_ids) == ref.token_ids
        steps = zip(completion.token_ids, completion.logprobs, ref.logprobs, strict=True)
        for token, got, want in steps:
            assert got[token].rank == 1
            assert set(got) == set(want), (got, want)  # the same top-5 tokens
            for t, lp in want.items():
                worst = max(worst, abs(got[t].logprob - lp))
    record_property("max_abs_logprob_diff", worst)
    assert worst <= LOGPROB_TOL, worst


@pytest.mark.feature("prompt_logprobs")
def test_prompt_logprobs_match_hf_log_softmax(main_llm, hf, record_property) -> None:
    """A 118-token prompt: prefilled in two chunks, its log-probs gathered across both."""
    (out,) = main_llm.generate([TEST_PROMPTS[7]], greedy_params(1, prompt_logprobs=3))
    ids = list(out.prompt_token_ids)
    assert len(ids) > 64 and out.prompt_logprobs[0] is None
    reference = hf.prompt_logprobs(ids)
    worst = 0.0
    for i, step in enumerate(out.prompt_logprobs[1:]):
        want = reference[i]
        assert {int(t) for t in want.topk(3).indices} <= set(step), (i, step)
        for t, lp in step.items():
            worst = max(worst, abs(lp.logprob - float(want[t])))
        assert step[ids[i + 1]].rank == 1 + int((want > want[ids[i + 1]]).sum())
    record_property("max_abs_logprob_diff", worst)
    assert worst <= LOGPROB_TOL, worst


# ---- penalties -------------------------------------------------------------------


@pytest.mark.feature("penalties")
def test_penalties_match_reference(main_llm, hf, greedy) -> None:
    """Repetition penalty: transformers' processor. Presence and frequency:
    vLLM's formula over transformers' logits."""
    knobs = dict(presence_penalty=1.0, frequency_penalty=0.5)
    params = [greedy_params(TOKENS, repetition_penalty=1.5)] * len(PROMPTS) + [
        greedy_params(TOKENS, **knobs)
    ] * len(PROMPTS)
    outputs = token_ids(main_llm.generate(PROMPTS * 2, params))
    repetition, openai_style = outputs[: len(PROMPTS)], outputs[len(PROMPTS) :]
    assert repetition != greedy and openai_style != greedy
    assert repetition == hf.generate(PROMPTS, TOKENS, repetition_penalty=1.5, eos_token_id=None)
    assert openai_style == [hf.penalized_greedy(p, TOKENS, **knobs) for p in PROMPTS]


# ---- stopping --------------------------------------------------------------------


@pytest.mark.feature("stop_strings")
def test_stop_string_ends_the_text_before_it(main_llm) -> None:
    """vLLM: generation stops at a stop string, which the output does not contain
    unless ``include_stop_str_in_output``."""
    prompt = [TEST_PROMPTS[2]]
    base = main_llm.generate(prompt, greedy_params(TOKENS))[0].outputs[0]
    text = base.text
    match = next(
        m
        for m in re.finditer(r"(?=([A-Za-z]{3}))", text)
        if m.start() >= 4 and text.find(m.group(1)) == m.start()
    )
    stop, at = match.group(1), match.start()

    params = [
        greedy_params(TOKENS, stop=[stop]),
        greedy_params(TOKENS, stop=[stop], include_stop_str_in_output=True),
    ]
    cut, kept = (o.outputs[0] for o in main_llm.generate(prompt * 2, params))
    assert (cut.text, cut.finish_reason, cut.stop_reason) == (text[:at], "stop", stop)
    assert len(cut.token_ids) < len(base.token_ids)
    assert kept.text == text[: at + len(stop)]


@pytest.mark.feature("stop_token_ids")
def test_stop_token_id_ends_generation_with_it(main_llm, greedy) -> None:
    base = greedy[0]
    k = next(i for i in range(4, len(base)) if base.index(base[i]) == i)
    params = greedy_params(TOKENS, stop_token_ids=[base[k]])
    out = main_llm.generate(PROMPTS[:1], params)[0].outputs[0]
    assert list(out.token_ids) == base[: k + 1]
    assert (out.finish_reason, out.stop_reason) == ("stop", base[k])


@pytest.mark.feature("allowed_token_ids")
def test_allowed_token_ids_restrict_what_is_sampled(main_llm) -> None:
    """vLLM: only ``allowed_token_ids`` can be sampled. A one-token list forces that
    token wherever it lies in the vocabulary (its first and last ids included);
    a longer list bounds random sampling; an empty list is refused."""
    vocab = main_llm.llm_engine.model_config.get_vocab_size()
    forced = sorted({1, 5, vocab // 3, vocab // 2 + 7, vocab - 1})
    prompt = TEST_PROMPTS[1]
    params = [greedy_params(1, allowed_token_ids=[t]) for t in forced]
    allowed = [3, vocab // 4, vocab - 2]
    params.append(sampling(temperature=1.0, seed=7, allowed_token_ids=allowed))
    outs = main_llm.generate([prompt] * len(params), params)
    assert [o.outputs[0].token_ids[-1] for o in outs[:-1]] == forced
    sampled = list(outs[-1].outputs[0].token_ids)
    assert len(sampled) == TOKENS and set(sampled) <= set(allowed)
    with pytest.raises(VLLMValidationError):
        main_llm.generate([prompt], greedy_params(1, allowed_token_ids=[]))


@pytest.mark.feature("max_tokens", "min_tokens", "ignore_eos", "logit_bias")
def test_eos_min_tokens_and_ignore_eos_match_hf(main_llm, hf) -> None:
    """A +4 logit bias on eos makes the random model end its answers; transformers
    with the same bias (its sequence-bias processor) is the reference for each mode."""
    prompts = list(TEST_PROMPTS[:3])
    n = len(prompts)
    min_tokens = 8

    def params(**kwargs: Any) -> list[SamplingParams]:
        bias = {EOS_TOKEN_ID: 4.0}
        return [SamplingParams(temperature=0.0, max_tokens=TOKENS, logit_bias=bias, **kwargs)] * n

    outputs = main_llm.generate(
        prompts * 3, params() + params(min_tokens=min_tokens) + params(ignore_eos=True)
    )
    stops, longer, ignoring = (
        [o.outputs[0] for o in outputs[i * n : (i + 1) * n]] for i in range(3)
    )
    hf_bias = dict(sequence_bias={(EOS_TOKEN_ID,): 4.0})

    assert any(o.finish_reason == "stop" for o in stops)
    assert all(o.token_ids[-1] == EOS_TOKEN_ID for o in stops if o.finish_reason == "stop")
    assert all(len(o.token_ids) <= TOKENS for o in stops)
    assert [list(o.token_ids) for o in stops] == hf.generate(
        prompts, TOKENS, eos_token_id=EOS_TOKEN_ID, **hf_bias
    )

    assert any(len(s.token_ids) < min_tokens for s in stops)  # min_tokens changes something
    assert all(len(o.token_ids) >= min_tokens for o in longer)
    assert [list(o.token_ids) for o in longer] == hf.generate(
        prompts, TOKENS, eos_token_id=EOS_TOKEN_ID, min_new_tokens=min_tokens, **hf_bias
    )

    assert all(len(o.token_ids) == TOKENS and o.finish_reason == "length" for o in ignoring)
    assert any(EOS_TOKEN_ID in o.token_ids[:-1] for o in ignoring)  # generated past an eos
    assert [list(o.token_ids) for o in ignoring] == hf.generate(
        prompts, TOKENS, eos_token_id=None, **hf_bias
    )


# ---- n > 1 -----------------------------------------------------------------------


@pytest.mark.feature("n")
def test_n_completions_per_prompt(main_llm) -> None:
    """n seeded samples per prompt, reproducible; vLLM refuses n > 1 with greedy
    sampling (identical completions)."""
    params = sampling(n=3, temperature=1.0, seed=9)
    first, again = main_llm.generate(PROMPTS[:1] * 2, params)
    assert sorted(c.index for c in first.outputs) == [0, 1, 2]
    samples = [list(c.token_ids) for c in first.outputs]
    assert all(len(s) == TOKENS for s in samples)
    assert len({tuple(s) for s in samples}) == 3, samples
    assert [list(c.token_ids) for c in again.outputs] == samples

    with pytest.raises(VLLMValidationError, match="n must be 1 when using greedy sampling"):
        main_llm.generate(PROMPTS[:1], greedy_params(TOKENS, n=2))
