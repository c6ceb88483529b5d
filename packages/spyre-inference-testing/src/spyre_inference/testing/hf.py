"""Hugging Face transformers references for comparing the plugin's outputs.

Greedy decoding runs **one prompt at a time** with the model's own KV cache:
batching would left-pad prompts of different lengths, and padding changes the
shapes (and so the floating-point reduction order) of every matmul, and with it
near-tie argmaxes. One at a time, the reference for a prompt does not depend on
which other prompts are in the test. The loop is a plain argmax over
transformers' logits, not ``model.generate``: ``generate`` merges
``generation_config.json`` defaults and stops at eos, whereas vLLM tests
usually set ``ignore_eos=True`` and let eos be an ordinary token. Compare token
ids, never decoded text.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping, Sequence
from typing import Any

import torch

DTypeLike = torch.dtype | str


def _dtype(dtype: DTypeLike) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    try:
        value = getattr(torch, str(dtype).removeprefix("torch."))
    except AttributeError:
        raise ValueError(f"unknown dtype {dtype!r}") from None
    if not isinstance(value, torch.dtype):
        raise ValueError(f"unknown dtype {dtype!r}")
    return value


@dataclasses.dataclass
class GreedyResult:
    """One prompt's greedy continuation and, per step, the top log-probabilities."""

    prompt_token_ids: list[int]
    token_ids: list[int]
    #: Per generated position: {token_id: logprob} of the ``num_logprobs`` most
    #: likely tokens (float32 log-softmax of the model's final logits), always
    #: containing the chosen token.
    logprobs: list[dict[int, float]]


def hf_greedy_with_logprobs(
    model_dir: str | os.PathLike[str],
    prompts: Sequence[str] | Sequence[Sequence[int]],
    max_new_tokens: int,
    dtype: DTypeLike = torch.float32,
    *,
    num_logprobs: int = 5,
    ignore_eos: bool = True,
) -> list[GreedyResult]:
    """Greedy decode each prompt with transformers, keeping top-k logprobs per step.

    ``prompts`` are strings (tokenized with the model folder's tokenizer, special
    tokens added as vLLM does for completions) or lists of token ids. With
    ``ignore_eos=False`` a sequence stops after the first eos it generates.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch_dtype = _dtype(dtype)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch_dtype).eval()
    eos = model.config.eos_token_id
    eos_ids = set(eos if isinstance(eos, list) else [] if eos is None else [eos])
    tokenizer = None
    results: list[GreedyResult] = []
    with torch.inference_mode():
        for prompt in prompts:
            if isinstance(prompt, str):
                if tokenizer is None:
                    tokenizer = AutoTokenizer.from_pretrained(model_dir)
                prompt_ids = list(tokenizer(prompt).input_ids)
            else:
                prompt_ids = [int(t) for t in prompt]
            result = GreedyResult(prompt_ids, [], [])
            input_ids = torch.tensor([prompt_ids])
            past = None
            for _ in range(max_new_tokens):
                out = model(input_ids=input_ids, past_key_values=past, use_cache=True)
                past = out.past_key_values
                logprobs = torch.log_softmax(out.logits[0, -1].float(), dim=-1)
                token = int(torch.argmax(logprobs))
                top = torch.topk(logprobs, num_logprobs)
                step = {int(i): float(v) for i, v in zip(top.indices, top.values, strict=True)}
                step.setdefault(token, float(logprobs[token]))
                result.token_ids.append(token)
                result.logprobs.append(step)
                if not ignore_eos and token in eos_ids:
                    break
                input_ids = torch.tensor([[token]])
            results.append(result)
    return results


def hf_input_embeddings(
    model_dir: str | os.PathLike[str], prompts: Sequence[str], dtype: DTypeLike = torch.float32
) -> list[torch.Tensor]:
    """Each prompt's ``[tokens, hidden]`` input embeddings from transformers' own
    embedding table (tokenized as vLLM does for completions): what a user hands
    vLLM as ``{"prompt_embeds": ...}`` with ``--enable-prompt-embeds``."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=_dtype(dtype)).eval()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    table = model.get_input_embeddings()
    with torch.inference_mode():
        return [table(torch.tensor(tokenizer(p).input_ids)).clone() for p in prompts]


def hf_greedy(
    model_dir: str | os.PathLike[str],
    prompts: Sequence[str] | Sequence[Sequence[int]],
    max_new_tokens: int,
    dtype: DTypeLike = torch.float32,
    *,
    ignore_eos: bool = True,
) -> list[list[int]]:
    """Greedy continuation token ids (prompt excluded) for each prompt, from transformers.

    Exact per prompt (no padding, see the module docstring). Pair it with vLLM
    ``SamplingParams(temperature=0, max_tokens=max_new_tokens, ignore_eos=True)``
    and compare ``output.token_ids``.
    """
    results = hf_greedy_with_logprobs(
        model_dir, prompts, max_new_tokens, dtype, num_logprobs=1, ignore_eos=ignore_eos
    )
    return [r.token_ids for r in results]


def assert_greedy_close(
    reference: Sequence[GreedyResult],
    outputs: Sequence[Sequence[int]],
    *,
    max_logprob_gap: float = 0.2,
    min_exact: int = 0,
) -> int:
    """Check greedy token ids against a reference, allowing divergence only at near-ties.

    Two implementations that round differently (bfloat16 kernels, another
    reduction order) pick different tokens when the reference's top two
    log-probabilities are closer than the rounding noise; after that the
    sequences legitimately differ. So, per prompt: the tokens must match up
    to the first difference; there, the chosen token must be one of the
    reference's top tokens at that step, within ``max_logprob_gap`` of the
    reference's choice; later tokens are not compared. (Measured on the tiny
    models, bfloat16 against float32 transformers: the gaps at the first
    divergence were 0.0001-0.052, hence the default 0.2; a real bug usually
    diverges at step 0 with a gap of several units.) Returns the number of
    sequences that matched exactly and asserts it is at least ``min_exact``.
    Build ``reference`` with :func:`hf_greedy_with_logprobs` (``num_logprobs``
    of at least 2).
    """
    assert len(reference) == len(outputs), (len(reference), len(outputs))
    exact = 0
    for index, (ref, out) in enumerate(zip(reference, outputs, strict=True)):
        out = list(out)
        assert len(out) == len(ref.token_ids), (
            f"prompt {index}: {len(out)} tokens generated, reference has {len(ref.token_ids)}"
        )
        step = next(
            (i for i, (a, b) in enumerate(zip(ref.token_ids, out, strict=True)) if a != b), None
        )
        if step is None:
            exact += 1
            continue
        ref_token, got = ref.token_ids[step], out[step]
        candidates = ref.logprobs[step]
        detail = (
            f"prompt {index} diverges at step {step}: reference {ref.token_ids[: step + 1]}, "
            f"got {out[: step + 1]}; reference top logprobs {candidates}"
        )
        assert got in candidates, detail + " (chosen token not among the reference's top tokens)"
        gap = candidates[ref_token] - candidates[got]
        assert gap <= max_logprob_gap, detail + f" (gap {gap:.4f} > {max_logprob_gap})"
    assert exact >= min_exact, f"only {exact} of {len(outputs)} sequences matched exactly"
    return exact


def hf_cross_encoder_scores(
    model_dir: str | os.PathLike[str],
    queries: Sequence[str],
    documents: Sequence[str],
    dtype: DTypeLike = torch.float32,
) -> list[float]:
    """Relevance of each (query, document) pair by a one-label sequence classifier.

    What vLLM's score and rerank APIs compute for such a cross-encoder: the
    pair tokenized together (so the document's tokens are of type 1 where the
    model has token types), the classifier's single logit, then a sigmoid.
    """
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForSequenceClassification.from_pretrained(model_dir, dtype=_dtype(dtype))
    model.eval()
    if model.config.num_labels != 1:
        labels = model.config.num_labels
        raise ValueError(f"a cross-encoder has one label; {model_dir} has {labels}")
    scores = []
    for query, document in zip(queries, documents, strict=True):
        enc = tokenizer(query, document, return_tensors="pt")
        with torch.inference_mode():
            scores.append(float(torch.sigmoid(model(**enc).logits[0, 0].float())))
    return scores


def vllm_greedy_with_top_logprobs(
    llm: Any, prompts: Sequence[str], max_tokens: int, k: int = 5
) -> tuple[list[list[int]], list[list[dict[int, float]]]]:
    """Greedy tokens of a ``vllm.LLM`` and each step's top-``k`` logprobs
    (``{token: logprob}``): the engine side of :func:`assert_greedy_top_k_close`."""
    from vllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, logprobs=k)
    outs = llm.generate(list(prompts), params)
    tokens = [list(o.outputs[0].token_ids) for o in outs]
    logprobs = [
        [{t: lp.logprob for t, lp in step.items()} for step in o.outputs[0].logprobs] for o in outs
    ]
    return tokens, logprobs


def assert_greedy_top_k_close(
    reference: Sequence[GreedyResult],
    outputs: Sequence[Sequence[int]],
    output_logprobs: Sequence[Sequence[Mapping[int, float]]],
    k: int = 5,
) -> int:
    """Each sequence is identical to the reference up to its first divergence, where
    each side's token is among the other's top ``k``; returns the exact count.

    The criterion for a quantized model against the 16-bit reference on the same
    (dequantized) weights: activation rounding moves near-ties, nothing more.
    ``output_logprobs`` are the plugin's per-step ``{token: logprob}`` (at least
    its top ``k``).
    """
    exact = 0
    for index, (ref, out, out_lp) in enumerate(
        zip(reference, outputs, output_logprobs, strict=True)
    ):
        step = next(
            (i for i, (a, b) in enumerate(zip(ref.token_ids, out, strict=False)) if a != b), None
        )
        if step is None:
            exact += 1
            continue
        ref_top = sorted(ref.logprobs[step], key=ref.logprobs[step].get, reverse=True)[:k]
        out_top = sorted(out_lp[step], key=out_lp[step].get, reverse=True)[:k]
        detail = (
            f"prompt {index} diverges at step {step}: reference {ref.token_ids[step]} "
            f"(top {ref_top}), got {out[step]} (top {out_top})"
        )
        assert out[step] in ref_top and ref.token_ids[step] in out_top, detail
    return exact
