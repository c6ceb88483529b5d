"""Top-k / top-p and random sampling on the host without sorting the vocabulary.

Sampling runs on the host on both targets (spec, "LogitsProcessor": the logits
leave the card before the sampler). vLLM picks its sampler by platform: its CPU
backend gets a compiled Gumbel-max kernel, every other platform without Triton
(this one) gets ``TopKTopPSampler.forward_native``. That path sorts the whole
vocabulary for top-p/top-k and draws one exponential per vocabulary entry: on
a 2-core host, 8 rows of SmolLM2's 49152-token vocabulary cost ~15 ms for the
sort and ~10 ms for the noise (``torch.Tensor.exponential_`` is scalar code),
more than the model's forward step at that batch (W3 in the benchmark report,
where requests inherit the checkpoint's ``temperature=0.2, top_p=0.9``).

:class:`HostTopKTopPSampler` gives the same distribution with less work:

* the tokens top-k and top-p keep are the highest-probability ones, so they are
  found with ``topk`` on a few candidates (64, then 4x more while a row's
  nucleus is not closed) instead of a full sort; a row that needs more than a
  quarter of the vocabulary falls back to the full sort, the same rule;
* the token is drawn by inverse CDF (one uniform per row, a cumulative sum and
  a binary search) instead of an exponential race over the whole vocabulary.

The rules are vLLM's (``apply_top_k_top_p_pytorch``): top-k keeps the ``k``
most likely tokens, then top-p keeps, of those renormalised, each token whose
more likely predecessors hold less than ``p`` of the mass. Seeded requests
draw their uniform from their own generator, so a seed gives the same tokens
whatever the batch. The random streams differ from vLLM's (as its CPU backend's
do), so seeded outputs are reproducible here, not equal to another backend's.
Modes that return processed logits for logprobs, and fp64 Gumbel noise, keep
vLLM's own path.
"""

from __future__ import annotations

import torch
from vllm.config.model import PROCESSED_LOGPROBS_MODES
from vllm.v1.sample.ops.topk_topp_sampler import TopKTopPSampler

#: Candidates examined first for a top-p row; most nuclei of a served model are
#: far smaller (a handful of tokens at temperature 0.2).
FIRST_CANDIDATES = 64
#: Candidate growth while some row's nucleus is still open.
GROWTH = 4


class HostTopKTopPSampler(TopKTopPSampler):
    """vLLM's top-k/top-p sampler module with a host path that does not sort the vocabulary."""

    def __init__(self, logprobs_mode: str = "raw_logprobs", use_fp64_gumbel: bool = False):
        super().__init__(logprobs_mode, use_fp64_gumbel)
        if logprobs_mode in PROCESSED_LOGPROBS_MODES or use_fp64_gumbel:
            # Processed logits must be returned over the whole vocabulary, and
            # fp64 Gumbel noise is a request for vLLM's exact noise: its path.
            self.forward = self.forward_native
        else:
            self.forward = self.forward_host

    def forward_host(
        self,
        logits: torch.Tensor,
        generators: dict[int, torch.Generator],
        k: torch.Tensor | None,
        p: torch.Tensor | None,
    ) -> tuple[torch.Tensor, None]:
        probs = logits.softmax(dim=-1, dtype=torch.float32)
        uniforms = draw_uniforms(probs.shape[0], generators)
        return sample_from_probs(probs, k, p, uniforms), None


def draw_uniforms(rows: int, generators: dict[int, torch.Generator]) -> torch.Tensor:
    """One float64 uniform in [0, 1) per row; a seeded row's from its own generator."""
    uniforms = torch.rand(rows, dtype=torch.float64)
    for row, generator in generators.items():
        uniforms[row] = torch.rand(1, dtype=torch.float64, generator=generator)
    return uniforms


def sample_from_probs(
    probs: torch.Tensor,
    k: torch.Tensor | None,
    p: torch.Tensor | None,
    uniforms: torch.Tensor,
    first_candidates: int = FIRST_CANDIDATES,
) -> torch.Tensor:
    """Token ids ``[rows]`` drawn from ``probs`` ``[rows, vocab]`` after top-k and top-p.

    ``k`` (int, ``vocab`` or more = off) and ``p`` (float, 1 = off) are per row
    or ``None`` for all rows off, as vLLM's sampling metadata holds them.
    ``uniforms`` are the rows' draws in [0, 1).
    """
    rows, vocab = probs.shape
    top_k, top_p = _per_row(rows, vocab, k, p)
    limited = (top_k < vocab) | (top_p < 1)
    if not bool(limited.any()):
        return _inverse_cdf(probs, torch.arange(vocab).expand(rows, vocab), uniforms)
    if bool(limited.all()):
        return _inverse_cdf(*truncate(probs, top_k, top_p, first_candidates), uniforms)
    tokens = torch.empty(rows, dtype=torch.long)
    whole = (~limited).nonzero().flatten()
    tokens[whole] = _inverse_cdf(
        probs[whole], torch.arange(vocab).expand(whole.numel(), vocab), uniforms[whole]
    )
    cut = limited.nonzero().flatten()
    weights, ids = truncate(probs[cut], top_k[cut], top_p[cut], first_candidates)
    tokens[cut] = _inverse_cdf(weights, ids, uniforms[cut])
    return tokens


def _per_row(
    rows: int, vocab: int, k: torch.Tensor | None, p: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    top_k = (
        torch.full((rows,), vocab, dtype=torch.long)
        if k is None
        else k.to(torch.long).clamp(1, vocab)
    )
    top_p = torch.ones(rows, dtype=torch.float32) if p is None else p.to(torch.float32)
    return top_k, top_p


def truncate(
    probs: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    first_candidates: int = FIRST_CANDIDATES,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The tokens top-k then top-p keep: ``(weights, ids)``, each ``[rows, candidates]``.

    ``weights`` are the kept tokens' probabilities (0 for a candidate cut),
    ``ids`` their token ids, most likely first. ``top_k`` (``vocab`` = off) and
    ``top_p`` (1 = off) hold one value per row.
    """
    vocab = probs.shape[-1]
    candidates = min(vocab, max(first_candidates, 1))
    while True:
        if candidates * 4 > vocab:
            candidates = vocab  # the full sort: as much work as vLLM's path
        values, ids = probs.topk(candidates, dim=-1, sorted=True)
        # Top-k: the first k candidates. A row whose k lies past the
        # candidates needs more of them (its renormalising mass is not known).
        in_k = torch.arange(candidates).unsqueeze(0) < top_k.unsqueeze(1)
        in_k_mass = torch.where(in_k, values, 0.0)
        has_k = top_k < vocab
        mass = torch.where(has_k, in_k_mass.sum(dim=-1), 1.0)
        # Top-p over the top-k renormalised: keep a candidate while the more
        # likely ones hold less than p of the mass (p = 1 keeps all: a float32
        # running sum may reach the total before the tail).
        before = in_k_mass.cumsum(dim=-1) - in_k_mass
        keep = in_k & ((before < (top_p * mass).unsqueeze(1)) | (top_p >= 1).unsqueeze(1))
        if candidates == vocab:
            break
        closed_by_k = top_k <= candidates
        closed_by_p = ~has_k & (in_k_mass.sum(dim=-1) >= top_p)
        if bool((closed_by_k | closed_by_p).all()):
            break
        candidates *= GROWTH
    return torch.where(keep, values, 0.0), ids


def _inverse_cdf(weights: torch.Tensor, ids: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Draw ``ids[row, j]`` with probability ``weights[row, j] / sum(weights[row])``.

    The cumulative sum is in float64 so that a 50k-entry vocabulary's tail keeps
    its share; ``right=True`` lands on the first entry whose cumulative weight
    passes the draw, which is never a zero-weight one.
    """
    cdf = weights.to(torch.float64).cumsum(dim=-1)
    total = cdf[:, -1:]
    # Strictly below the total, so a draw rounding up cannot land past the last
    # kept entry (onto a cut one).
    target = torch.minimum(
        uniforms.unsqueeze(1) * total, torch.nextafter(total, total.new_zeros(()))
    )
    index = torch.searchsorted(cdf, target, right=True)
    return ids.gather(1, index).squeeze(1)
