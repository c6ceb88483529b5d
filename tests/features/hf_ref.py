"""Hugging Face transformers references beyond plain greedy decoding.

All run the float32 model one prompt at a time (see
``spyre_inference.testing.hf``: no padding, so a prompt's reference
does not depend on the other prompts). ``generate`` is transformers' own
``model.generate`` with its logits processors (repetition penalty, sequence
bias, minimum length, beam search); what transformers has no processor for
(OpenAI-style presence/frequency penalties) is written out in plain PyTorch
over transformers' logits, following vLLM's documented formula.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from spyre_inference.testing import PAD_TOKEN_ID


@dataclasses.dataclass
class HFModel:
    model: Any
    tokenizer: Any

    @classmethod
    def load(cls, path: Path) -> HFModel:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        return cls(model, AutoTokenizer.from_pretrained(path))

    def ids(self, prompt: str | Sequence[int]) -> list[int]:
        """Token ids as vLLM's completion path makes them (special tokens added)."""
        if isinstance(prompt, str):
            return list(self.tokenizer(prompt).input_ids)
        return [int(t) for t in prompt]

    @torch.inference_mode()
    def generate(
        self, prompts: Sequence[str | Sequence[int]], max_new_tokens: int, **kwargs: Any
    ) -> list[list[int]]:
        """New token ids of ``model.generate`` (greedy unless ``kwargs`` say otherwise)."""
        kwargs.setdefault("do_sample", False)
        kwargs.setdefault("pad_token_id", PAD_TOKEN_ID)
        results = []
        for prompt in prompts:
            ids = torch.tensor([self.ids(prompt)])
            out = self.model.generate(
                ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens, **kwargs
            )
            results.append(out[0, ids.shape[1] :].tolist())
        return results

    @torch.inference_mode()
    def penalized_greedy(
        self,
        prompt: str | Sequence[int],
        max_new_tokens: int,
        *,
        presence_penalty: float,
        frequency_penalty: float,
    ) -> list[int]:
        """Greedy decoding with OpenAI-style penalties over the *generated* tokens.

        vLLM's ``SamplingParams`` documents them as: presence penalises a token
        that appeared in the generated text so far, frequency by how often it
        did; both are subtracted from the logits.
        """
        counts = torch.zeros(self.model.config.vocab_size)
        input_ids = torch.tensor([self.ids(prompt)])
        past = None
        generated: list[int] = []
        for _ in range(max_new_tokens):
            out = self.model(input_ids=input_ids, past_key_values=past, use_cache=True)
            past = out.past_key_values
            logits = out.logits[0, -1].float()
            logits = logits - frequency_penalty * counts - presence_penalty * (counts > 0).float()
            token = int(torch.argmax(logits))
            generated.append(token)
            counts[token] += 1
            input_ids = torch.tensor([[token]])
        return generated

    @torch.inference_mode()
    def prompt_logprobs(self, prompt: str | Sequence[int]) -> torch.Tensor:
        """``[len - 1, vocab]`` float32 log-softmax predicting prompt tokens 1..len-1."""
        ids = torch.tensor([self.ids(prompt)])
        logits = self.model(input_ids=ids).logits[0, :-1].float()
        return torch.log_softmax(logits, dim=-1)
