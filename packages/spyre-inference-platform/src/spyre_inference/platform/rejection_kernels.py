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

import torch

#: vLLM marks padded draft slots with -1 (rejected by definition).
PADDED_DRAFT = -1


def _spans(cu_num_tokens: torch.Tensor) -> list[tuple[int, int]]:
    ends = cu_num_tokens.tolist()
    starts = [0, *ends[:-1]]
    return list(zip(starts, ends, strict=True))


def _write(output: torch.Tensor, rows: list[int], cols: list[int], values: list[int]) -> None:
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
    bonus = bonus_token_ids_ptr.reshape(-1).tolist()
    greedy = None if is_greedy_ptr is None else is_greedy_ptr.reshape(-1).tolist()
    uniform = uniform_probs_ptr.reshape(-1).tolist() if SYNTHETIC_MODE else None
    rates = synthetic_conditional_rates_ptr.reshape(-1).tolist() if SYNTHETIC_MODE else None
    rows: list[int] = []
    cols: list[int] = []
    values: list[int] = []
    for req, (start, end) in enumerate(_spans(cu_num_draft_tokens_ptr)):
        if greedy is not None and not greedy[req]:
            continue
        rejected = False
        for pos in range(end - start):
            token = draft[start + pos]
            if SYNTHETIC_MODE:
                accepted = uniform[start + pos] < rates[pos] and token >= 0
                value = token if accepted else target[start + pos]
                rejected = not accepted
            else:
                value = target[start + pos]
                rejected = token != value
            rows.append(req)
            cols.append(pos)
            values.append(value)
            if rejected:
                break
        if not rejected:
            rows.append(req)
            cols.append(end - start)
            values.append(bonus[req])
    _write(output_token_ids_ptr, rows, cols, values)


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
    rows_all = torch.arange(ids.shape[0], device=ids.device)
    safe = ids.clamp(min=0)
    target_p = target_probs_ptr[rows_all, safe].tolist()
    draft_p = None if NO_DRAFT_PROBS else draft_probs_ptr[rows_all, safe].tolist()
    draft = ids.tolist()
    uniform = uniform_probs_ptr.reshape(-1).tolist()
    recovered = recovered_token_ids_ptr.reshape(-1).tolist()
    bonus = bonus_token_ids_ptr.reshape(-1).tolist()
    greedy = is_greedy_ptr.reshape(-1).tolist()
    rates = synthetic_conditional_rates_ptr.reshape(-1).tolist() if SYNTHETIC_MODE else None
    rows: list[int] = []
    cols: list[int] = []
    values: list[int] = []
    for req, (start, end) in enumerate(_spans(cu_num_draft_tokens_ptr)):
        if greedy[req]:
            continue
        rejected = False
        for pos in range(end - start):
            t = start + pos
            if draft[t] < 0:
                accepted = False
            elif SYNTHETIC_MODE:
                accepted = uniform[t] < rates[pos]
            else:
                p_draft = 1.0 if draft_p is None else draft_p[t]
                # A zero draft probability is rejected rather than divided by.
                accepted = p_draft > 0 and target_p[t] / p_draft >= uniform[t]
            rows.append(req)
            cols.append(pos)
            values.append(draft[t] if accepted else recovered[t])
            if not accepted:
                rejected = True
                break
        if not rejected:
            rows.append(req)
            cols.append(end - start)
            values.append(bonus[req])
    _write(output_token_ids_ptr, rows, cols, values)


def expand(
    output_ptr: torch.Tensor,
    input_ptr: torch.Tensor,
    cu_num_tokens_ptr: torch.Tensor,
    replace_from: int,
    replace_to: int,
    MAX_NUM_TOKENS: int,
) -> None:
    """``expand_kernel``: ``output[start:end] = input[r]`` (``replace_from`` -> ``replace_to``)."""
    counts = torch.diff(cu_num_tokens_ptr.long(), prepend=cu_num_tokens_ptr.new_zeros(1).long())
    # The kernel writes at most MAX_NUM_TOKENS tokens per request.
    counts = counts.clamp(max=MAX_NUM_TOKENS)
    values = torch.where(
        input_ptr == replace_from, torch.full_like(input_ptr, replace_to), input_ptr
    )
    starts = cu_num_tokens_ptr.long() - torch.diff(
        cu_num_tokens_ptr.long(), prepend=cu_num_tokens_ptr.new_zeros(1).long()
    )
    index = torch.cat(
        [torch.arange(s, s + c) for s, c in zip(starts.tolist(), counts.tolist(), strict=True)]
        or [torch.empty(0, dtype=torch.long)]
    ).to(output_ptr.device)
    output_ptr[index] = torch.repeat_interleave(values, counts.to(values.device)).to(
        output_ptr.dtype
    )


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
    counts = torch.diff(
        cu_num_draft_tokens_ptr.long(), prepend=cu_num_draft_tokens_ptr.new_zeros(1).long()
    )
    request = torch.repeat_interleave(torch.arange(counts.shape[0]), counts)
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
