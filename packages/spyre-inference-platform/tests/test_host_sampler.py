"""The host sampler against vLLM's own PyTorch sampler (``apply_top_k_top_p_pytorch``).

The reference for which tokens survive top-k / top-p is vLLM's full-sort
implementation on the same logits; the reference for the draw is the exact
distribution over the survivors (vLLM's softmax of its masked logits).
"""

from __future__ import annotations

import pytest
import torch
from vllm.v1.sample.ops.topk_topp_sampler import apply_top_k_top_p_pytorch

from spyre_inference.platform.host_sampler import (
    HostTopKTopPSampler,
    sample_from_probs,
    truncate,
)

VOCAB = 4096


def _logits(rows: int, scale: float, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(rows, VOCAB, generator=generator) * scale


def _vllm_kept(logits: torch.Tensor, k: torch.Tensor | None, p: torch.Tensor | None):
    masked = apply_top_k_top_p_pytorch(logits.clone(), k, p)
    return [set(torch.isfinite(row).nonzero().flatten().tolist()) for row in masked], masked


def _ours_kept(logits, k, p, first):
    probs = logits.softmax(-1)
    rows, vocab = probs.shape
    top_k = torch.full((rows,), vocab) if k is None else k
    top_p = torch.ones(rows) if p is None else p
    weights, ids = truncate(probs, top_k, top_p, first)
    return [set(i[w > 0].tolist()) for w, i in zip(weights, ids, strict=True)]


@pytest.mark.parametrize("first", [64, 8])
@pytest.mark.parametrize("scale", [0.5, 3.0, 12.0])
def test_kept_tokens_equal_vllms(first: int, scale: float) -> None:
    """Mixed rows: top-k only, top-p only, both, neither. Flat logits (scale 0.5)
    need the candidate growth and the full-sort fallback; sharp ones (12) close
    on the first candidates."""
    logits = _logits(8, scale, seed=int(scale * 10) + first)
    k = torch.tensor([VOCAB, 5, 50, VOCAB, 700, VOCAB, 1, 2000])
    p = torch.tensor([0.9, 1.0, 0.5, 0.99, 0.95, 1.0, 0.3, 0.6])
    ours = _ours_kept(logits, k, p, first)
    reference, _ = _vllm_kept(logits, k, p)
    for row, (got, want) in enumerate(zip(ours, reference, strict=True)):
        if k[row] == VOCAB and p[row] == 1.0:
            assert got == set(range(VOCAB)), row
        else:
            assert got == want, (row, len(got), len(want))


def test_top_p_alone_and_top_k_alone_equal_vllms() -> None:
    logits = _logits(4, 4.0, seed=3)
    p = torch.tensor([0.1, 0.5, 0.9, 0.999])
    assert _ours_kept(logits, None, p, 64) == _vllm_kept(logits, None, p)[0]
    k = torch.tensor([1, 3, 64, 300])
    assert _ours_kept(logits, k, None, 64) == _vllm_kept(logits, k, None)[0]


def test_draws_follow_vllms_distribution_exactly() -> None:
    """A grid of uniforms in place of random ones: each token's share of the grid
    equals its probability under vLLM's masked softmax, to the grid's step."""
    small = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0, -3.0, 1.5, 0.2]] * 3)
    k = torch.tensor([8, 4, 8])
    p = torch.tensor([1.0, 1.0, 0.8])
    _, masked = _vllm_kept(small, k, p)
    expected = masked.softmax(-1)
    steps = 20_000
    grid = (torch.arange(steps, dtype=torch.float64) + 0.5) / steps
    probs = small.softmax(-1)
    counts = torch.zeros_like(expected)
    for u in grid.split(2000):
        for row in range(3):
            tokens = sample_from_probs(
                probs[row].expand(len(u), -1), k[row].expand(len(u)), p[row].expand(len(u)), u
            )
            counts[row] += torch.bincount(tokens, minlength=8)
    assert torch.allclose(counts / steps, expected, atol=2 / steps)


def test_seeded_rows_repeat_whatever_the_batch() -> None:
    sampler = HostTopKTopPSampler()
    logits = _logits(3, 1.0, seed=9)
    p = torch.tensor([0.9, 0.9, 0.9])

    def draw(order, seeds):
        generators = {i: torch.Generator().manual_seed(s) for i, s in enumerate(seeds) if s}
        tokens, processed = sampler(logits[order].clone(), generators, None, p[order])
        assert processed is None
        return tokens.tolist()

    first = [draw([0, 1, 2], [7, 8, 9]) for _ in range(2)]
    assert first[0] == first[1]
    # Row 0's request alone at another position, next to an unseeded row.
    swapped = draw([2, 0], [None, 7])
    assert swapped[1] == first[0][0]


def test_processed_logprob_modes_keep_vllms_path() -> None:
    sampler = HostTopKTopPSampler(logprobs_mode="processed_logprobs")
    assert sampler.forward == sampler.forward_native
    default = HostTopKTopPSampler()
    assert default.forward == default.forward_host
