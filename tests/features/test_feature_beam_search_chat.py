"""``LLM.beam_search`` and ``LLM.chat`` against Hugging Face transformers.

Beam search: vLLM's beam search (``LLM.beam_search``) and transformers'
``generate(num_beams=...)`` keep the same beams when every beam runs to
``max_tokens`` (``ignore_eos``, no length penalty): same token sequences in
the same order, cumulative log-probabilities within 1e-4 (float32).

Chat: ``LLM.chat`` renders the model's chat template (the tiny models carry
one) into the same token ids as transformers' ``apply_chat_template``, and
the greedy answer equals transformers' greedy decoding of those ids.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from spyre_inference.testing import TEST_PROMPTS, hf_greedy
from tests.features.hf_ref import HFModel
from tests.features.util import greedy_params, token_ids

BEAMS = 3
BEAM_TOKENS = 6
LOGPROB_TOL = 1e-4


@pytest.mark.feature("beam_search")
def test_beam_search_matches_hf(main_llm, feature_model: Path, record_property) -> None:
    from vllm.sampling_params import BeamSearchParams

    prompts = [TEST_PROMPTS[7]]  # 118 tokens: chunked, two KV blocks
    params = BeamSearchParams(beam_width=BEAMS, max_tokens=BEAM_TOKENS, ignore_eos=True)
    results = main_llm.beam_search([{"prompt": p} for p in prompts], params)
    hf = HFModel.load(feature_model)

    for prompt, result in zip(prompts, results, strict=True):
        ids = torch.tensor([hf.ids(prompt)])
        with torch.inference_mode():
            ref = hf.model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                do_sample=False,
                num_beams=BEAMS,
                num_return_sequences=BEAMS,
                max_new_tokens=BEAM_TOKENS,
                early_stopping=False,
                length_penalty=1.0,
                eos_token_id=None,
                pad_token_id=0,
                output_scores=True,
                return_dict_in_generate=True,
            )
        want = [ref.sequences[i, ids.shape[1] :].tolist() for i in range(BEAMS)]
        # transformers reports sum(logprobs) / generated_length ** length_penalty
        want_cum = [float(s) * BEAM_TOKENS for s in ref.sequences_scores]
        got = [s.tokens[-BEAM_TOKENS:] for s in result.sequences]
        assert got == want, (got, want)
        diffs = [abs(s.cum_logprob - c) for s, c in zip(result.sequences, want_cum, strict=True)]
        record_property("max_abs_cum_logprob_diff", max(diffs))
        assert max(diffs) <= LOGPROB_TOL, (result.sequences, want_cum)


@pytest.mark.feature("chat")
def test_chat_applies_the_template_and_matches_hf(main_llm, feature_model: Path) -> None:
    conversations = [
        [{"role": "user", "content": "What is the capital of France?"}],
        [
            {"role": "system", "content": "You answer in one word."},
            {"role": "user", "content": "Name a colour."},
            {"role": "assistant", "content": "Blue."},
            {"role": "user", "content": "Another one?"},
        ],
    ]
    outputs = main_llm.chat(conversations, greedy_params(16))
    hf = HFModel.load(feature_model)
    rendered = [
        list(
            hf.tokenizer.apply_chat_template(
                c, add_generation_prompt=True, tokenize=True, return_dict=False
            )
        )
        for c in conversations
    ]
    assert [list(o.prompt_token_ids) for o in outputs] == rendered
    assert token_ids(outputs) == hf_greedy(feature_model, rendered, 16, "float32")
