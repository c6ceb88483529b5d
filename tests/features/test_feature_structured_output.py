"""Structured output through vLLM's guided decoding (xgrammar, grammar bitmask on the host).

The engine's logits reach vLLM's sampler on the host on both targets, where
vLLM applies the grammar's token bitmask (its CPU path). Each check also runs
the same request unconstrained, and the random-weight model's free text must
*fail* the constraint, so a bitmask that was never applied cannot pass.
Engines use vLLM's ``disable_any_whitespace`` (xgrammar): a random model
otherwise fills a JSON document with whitespace until ``max_tokens``.

* ``LLM`` (compiled, token-major): JSON schema, regex and choice.
* ``vllm serve`` (head-major): a JSON-schema ``response_format`` through
  ``/v1/chat/completions`` with the official ``openai`` client, validated with
  ``jsonschema``.
"""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
from vllm import SamplingParams
from vllm.sampling_params import StructuredOutputsParams

from spyre_inference.testing import TEST_PROMPTS
from tests.features.util import SERVED_NAME

SCHEMA = {
    "type": "object",
    "properties": {
        "answer": {"type": "string", "enum": ["yes", "no"]},
        "count": {"type": "integer", "minimum": 0, "maximum": 99},
        # A pattern rather than free text: xgrammar lets raw control characters
        # into JSON strings, which JSON (and json.loads) forbid.
        "tags": {
            "type": "array",
            "items": {"type": "string", "pattern": "^[a-z]{1,6}$"},
            "maxItems": 3,
        },
    },
    "required": ["answer", "count", "tags"],
    "additionalProperties": False,
}
REGEX = r"[a-z]{3,8}-[0-9]{2}"
CHOICES = ["red", "green", "blue"]
PROMPTS = list(TEST_PROMPTS[1:3])
MAX_TOKENS = 64
#: Enough free text to tell it from a constrained answer.
FREE_TOKENS = 16


def _valid_json(text: str) -> bool:
    try:
        jsonschema.validate(json.loads(text), SCHEMA)
    except (ValueError, jsonschema.ValidationError):
        return False
    return True


def _texts(llm, constraint: StructuredOutputsParams) -> tuple[list[str], list[str]]:
    """Greedy answers to PROMPTS with the constraint, and without it (one batch)."""
    guided = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, structured_outputs=constraint)
    free = SamplingParams(temperature=0.0, max_tokens=FREE_TOKENS)
    n = len(PROMPTS)
    outputs = [o.outputs[0] for o in llm.generate(PROMPTS * 2, [guided] * n + [free] * n)]
    assert all(o.finish_reason == "stop" for o in outputs[:n]), [o.text for o in outputs]
    return [o.text for o in outputs[:n]], [o.text for o in outputs[n:]]


@pytest.mark.feature("structured_json")
def test_json_schema(main_llm) -> None:
    texts, free = _texts(main_llm, StructuredOutputsParams(json=SCHEMA))
    assert all(_valid_json(t) for t in texts), texts
    assert not any(_valid_json(t) for t in free), free


@pytest.mark.feature("structured_regex")
def test_regex(main_llm) -> None:
    texts, free = _texts(main_llm, StructuredOutputsParams(regex=REGEX))
    assert all(re.fullmatch(REGEX, t) for t in texts), texts
    assert not any(re.fullmatch(REGEX, t) for t in free), free


@pytest.mark.feature("structured_choice")
def test_choice(main_llm) -> None:
    texts, free = _texts(main_llm, StructuredOutputsParams(choice=CHOICES))
    assert all(t in CHOICES for t in texts), texts
    assert not any(t in CHOICES for t in free), free


@pytest.mark.feature("structured_json_chat_api")
def test_chat_completions_json_schema_is_valid(head_major_client, record_property) -> None:
    questions = ["Is the sky blue?", "How many legs does a spider have?", "Tag this: cats"]
    response_format = {
        "type": "json_schema",
        "json_schema": {"name": "answer", "schema": SCHEMA, "strict": True},
    }
    for question in questions:
        messages = [{"role": "user", "content": question}]
        out = head_major_client.chat.completions.create(
            model=SERVED_NAME,
            messages=messages,
            max_tokens=MAX_TOKENS,
            temperature=0,
            response_format=response_format,
        )
        content = out.choices[0].message.content
        assert out.choices[0].finish_reason == "stop", content
        jsonschema.validate(json.loads(content), SCHEMA)
        record_property("answer", content)

        free = head_major_client.chat.completions.create(
            model=SERVED_NAME, messages=messages, max_tokens=FREE_TOKENS, temperature=0
        )
        assert not _valid_json(free.choices[0].message.content)
