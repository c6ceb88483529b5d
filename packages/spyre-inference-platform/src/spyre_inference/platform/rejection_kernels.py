"""PyTorch stand-ins for vLLM's Triton rejection-sampler kernels (speculative decoding).

Speculative decoding verifies draft tokens in vLLM's ``RejectionSampler``,
which launches four Triton kernels (``vllm/v1/sample/rejection_sampler.py``).
There is no Triton backend here (no GPU; vLLM is built with
``VLLM_TARGET_DEVICE=empty``), and vLLM's own CPU replacements call
``torch.ops._C``, which this build does not have. vLLM's documented seam for
that is ``Platform.register_triton_kernel_overrides`` with
``vllm.triton_utils.dispatcher.register_kernels``: the platform registers the
functions below under the kernels' names.

On both targets sampling runs on the host (spec, "Device Placement
Strategy": logits move to the CPU before the sampler), so these are host code.
Each function takes the kernel's own parameter names (the dispatcher then
forwards launch arguments by name) and writes its outputs in place, as the
kernel does. The loops run per request over at most ``max_spec_len`` draft
tokens: a few hundred Python operations per step, against a model step of
milliseconds.

Semantics, per request ``r`` with draft tokens ``[start, end)`` of the flat
token axis (``cu_num_draft_tokens`` is the inclusive prefix sum):

* greedy: accept draft tokens while each equals the target argmax; the first
  mismatch writes the target's token and stops; all accepted -> the bonus
  token follows;
* random: accept with probability ``min(1, p_target / p_draft)`` (``p_draft``
  is 1 for draft methods without probabilities, such as ngram); the first
  rejection writes the recovered token; all accepted -> the bonus token;
* recovered tokens: ``argmax(max(p_target - p_draft, 0) / q)`` with ``q`` the
  request's exponential noise (a Gumbel-max sample of the residual
  distribution; without draft probabilities the draft token is excluded);
* expand: broadcast a per-request value over the request's tokens.

Synthetic mode (vLLM's acceptance-rate simulation for benchmarks) is honoured
as the kernels define it.
"""

from __future__ import annotations

from collections.abc import Callable

import torch


def _spans(cu_num_tokens: torch.Tensor) -> list[tuple[int, int]]:
    """``[start, end)`` of each request on the flat token axis (inclusive prefix sum)."""
    ends = cu_num_tokens.tolist()
    starts = [0, *ends[:-1]]
    return list(zip(starts, ends, strict=True))


def _accept_prefix(
    output: torch.Tensor,
    cu_num_draft_tokens: torch.Tensor,
    skip: list[bool],
    judge: Callable[[int, int], tuple[bool, int]],
    bonus: list[int],
) -> None:
    """The loop both rejection kernels share, per request not in ``skip``.

    ``judge(pos, t)`` says whether draft ``pos`` (flat index ``t``) is accepted
    and which token goes to ``output[req, pos]``; the first rejection ends the
    request, and a request whose drafts are all accepted gets its bonus token.
    """
    rows: list[int] = []
    cols: list[int] = []
    values: list[int] = []
    for req, (start, end) in enumerate(_spans(cu_num_draft_tokens)):
        if skip[req]:
            continue
        accepted = True
        for pos in range(end - start):
            accepted, value = judge(pos, start + pos)
            rows.append(req)
            cols.append(pos)
            values.append(value)
            if not accepted:
                break
        if accepted:
            rows.append(req)
            cols.append(end - start)
            values.append(bonus[req])
    if rows:
        output[rows, cols] = torch.tensor(values, dtype=output.dtype, device=output.device)


def rejection_greedy_sample(
    output_token_ids_ptr: torch.Tensor,
    cu_num_draft_tokens_ptr: torch.Tensor,
    draft_token_ids_ptr: torch.Tensor,
    target_argmax_ptr: torch.Tensor,
    bonus_token_ids_ptr: torch.Tensor,
    is_greedy_ptr: torch.Tensor | None,
    max_spec_len: int,
    uniform_probs_ptr: torch.Tensor | None,
    synthetic_conditional_rates_ptr: torch.Tensor | None,
    SYNTHETIC_MODE: bool,
) -> None:
    """``rejection_greedy_sample_kernel``: greedy requests' accepted tokens."""
    draft = draft_token_ids_ptr.reshape(-1).tolist()
    target = target_argmax_ptr.reshape(-1).tolist()
    uniform = uniform_probs_ptr.reshape(-1).tolist() if SYNTHETIC_MODE else None
    rates = synthetic_conditional_rates_ptr.reshape(-1).tolist() if SYNTHETIC_MODE else None

    def judge(pos: int, t: int) -> tuple[bool, int]:
        if SYNTHETIC_MODE:
            accepted = uniform[t] < rates[pos] and draft[t] >= 0
            return accepted, draft[t] if accepted else target[t]
        return draft[t] == target[t], target[t]

    batch = output_token_ids_ptr.shape[0]
    greedy = [True] * batch if is_greedy_ptr is None else is_greedy_ptr.reshape(-1).tolist()
    skip = [not g for g in greedy]
    bonus = bonus_token_ids_ptr.reshape(-1).tolist()
    _accept_prefix(output_token_ids_ptr, cu_num_draft_tokens_ptr, skip, judge, bonus)


def rejection_random_sample(
    output_token_ids_ptr: torch.Tensor,
    cu_num_draft_tokens_ptr: torch.Tensor,
    draft_token_ids_ptr: torch.Tensor,
    draft_probs_ptr: torch.Tensor | None,
    target_probs_ptr: torch.Tensor,
    bonus_token_ids_ptr: torch.Tensor,
    recovered_token_ids_ptr: torch.Tensor,
    uniform_probs_ptr: torch.Tensor,
    is_greedy_ptr: torch.Tensor,
    max_spec_len: int,
    vocab_size: int,
    synthetic_conditional_rates_ptr: torch.Tensor | None,
    NO_DRAFT_PROBS: bool,
    SYNTHETIC_MODE: bool,
) -> None:
    """``rejection_random_sample_kernel``: sampled requests' accepted tokens."""
    ids = draft_token_ids_ptr.reshape(-1).long()
    rows = torch.arange(ids.shape[0], device=ids.device)
    safe = ids.clamp(min=0)
    target_p = target_probs_ptr[rows, safe].tolist()
    draft_p = None if NO_DRAFT_PROBS else draft_probs_ptr[rows, safe].tolist()
    draft = ids.tolist()
    uniform = uniform_probs_ptr.reshape(-1).tolist()
    recovered = recovered_token_ids_ptr.reshape(-1).tolist()
    rates = synthetic_conditional_rates_ptr.reshape(-1).tolist() if SYNTHETIC_MODE else None

    def judge(pos: int, t: int) -> tuple[bool, int]:
        if draft[t] < 0:  # a padded draft slot: rejected by definition
            accepted = False
        elif SYNTHETIC_MODE:
            accepted = uniform[t] < rates[pos]
        else:
            p_draft = 1.0 if draft_p is None else draft_p[t]
            # A zero draft probability is rejected rather than divided by.
            accepted = p_draft > 0 and target_p[t] / p_draft >= uniform[t]
        return accepted, draft[t] if accepted else recovered[t]

    skip = is_greedy_ptr.reshape(-1).tolist()
    bonus = bonus_token_ids_ptr.reshape(-1).tolist()
    _accept_prefix(output_token_ids_ptr, cu_num_draft_tokens_ptr, skip, judge, bonus)


def expand(
    output_ptr: torch.Tensor,
    input_ptr: torch.Tensor,
    cu_num_tokens_ptr: torch.Tensor,
    replace_from: int,
    replace_to: int,
    MAX_NUM_TOKENS: int,
) -> None:
    """``expand_kernel``: ``output[start:end] = input[r]`` (``replace_from`` -> ``replace_to``)."""
    values = input_ptr.tolist()
    for req, (start, end) in enumerate(_spans(cu_num_tokens_ptr)):
        # The kernel writes at most MAX_NUM_TOKENS tokens per request.
        stop = min(end, start + MAX_NUM_TOKENS)
        value = replace_to if values[req] == replace_from else values[req]
        output_ptr[start:stop] = value


def sample_recovered_tokens(
    output_token_ids_ptr: torch.Tensor,
    cu_num_draft_tokens_ptr: torch.Tensor,
    draft_token_ids_ptr: torch.Tensor,
    draft_probs_ptr: torch.Tensor | None,
    target_probs_ptr: torch.Tensor,
    inv_q_ptr: torch.Tensor,
    vocab_size: int,
    BLOCK_SIZE: int,
    NO_DRAFT_PROBS: bool,
    USE_FP64_GUMBEL: bool,
) -> None:
    """``sample_recovered_tokens_kernel``: one Gumbel-max draw per draft position."""
    # The kernel addresses flat arrays; callers may hand [num_tokens, 1] views.
    draft_ids = draft_token_ids_ptr.reshape(-1)
    out = output_token_ids_ptr.view(-1)
    num_tokens = draft_ids.shape[0]
    if num_tokens == 0:
        return
    counts = [end - start for start, end in _spans(cu_num_draft_tokens_ptr)]
    request = torch.repeat_interleave(torch.arange(len(counts)), torch.tensor(counts))
    if NO_DRAFT_PROBS:
        prob = target_probs_ptr[:num_tokens].clone()
        ids = draft_ids.long()
        keep = ids >= 0  # a padded draft (-1) excludes nothing
        prob[torch.arange(num_tokens)[keep], ids[keep]] = 0.0
    else:
        prob = (target_probs_ptr[:num_tokens] - draft_probs_ptr[:num_tokens]).clamp(min=0.0)
    score = prob.to(inv_q_ptr.dtype) * inv_q_ptr[request.to(inv_q_ptr.device)]
    out[:num_tokens] = score.argmax(dim=-1).clamp(max=vocab_size - 1).to(out.dtype)


#: vLLM kernel name -> its stand-in (``register_kernels`` takes this mapping).
OVERRIDES = {
    "vllm.v1.sample.rejection_sampler.rejection_greedy_sample_kernel": rejection_greedy_sample,
    "vllm.v1.sample.rejection_sampler.rejection_random_sample_kernel": rejection_random_sample,
    "vllm.v1.sample.rejection_sampler.expand_kernel": expand,
    "vllm.v1.sample.rejection_sampler.sample_recovered_tokens_kernel": sample_recovered_tokens,
}

__all__ = [
    "OVERRIDES",
    "expand",
    "rejection_greedy_sample",
    "rejection_random_sample",
    "sample_recovered_tokens",
]
