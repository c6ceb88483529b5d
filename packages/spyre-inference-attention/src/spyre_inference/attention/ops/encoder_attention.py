"""Bidirectional attention over a dense, padded batch (encoder / encoder-only layers).

The encoder backend packs a step's ragged sequences into a workspace
``[num_seqs * seq_len, num_heads, head]`` (row ``s * L + i`` is token ``i`` of
sequence ``s``; padding rows stay zero), viewed here as
``[num_seqs, seq_len, heads, head]``. Two paths (spec, "Encoder-only
attention"):

* **padded**: a compiled ``Q @ K^T`` (:func:`encoder_scores`), the additive
  mask added eagerly by the caller, and a compiled softmax and ``P @ V``
  (:func:`encoder_probs_v`). The matmuls stay separate graphs so Inductor
  cannot fuse them into a ``scaled_dot_product_attention``, which drops the
  additive mask on Spyre;
* **no padding** (one sequence filling its bucket exactly): a fused
  ``scaled_dot_product_attention`` (:func:`encoder_fused`).

Query groups (GQA/MQA encoders) fold into the row axis, as in the decoder
kernels.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def encoder_scores(
    q: torch.Tensor, k: torch.Tensor, scale: float, stats: torch.dtype
) -> torch.Tensor:
    """``[S, KVH, G * L, L]`` scores (``stats`` dtype) of ``[S, L, H, D]`` / ``[S, L, KVH, D]``."""
    num_seqs, seq_len, num_heads, head_size = q.shape
    num_kv_heads = k.shape[2]
    groups = num_heads // num_kv_heads
    qf = q.view(num_seqs, seq_len, num_kv_heads, groups, head_size).permute(0, 2, 3, 1, 4)
    qf = qf.reshape(num_seqs, num_kv_heads, groups * seq_len, head_size)
    kt = k.permute(0, 2, 3, 1)  # [S, KVH, D, L]
    return torch.matmul(qf, kt).to(stats) * scale


def encoder_probs_v(scores: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Softmax of masked ``[S, KVH, G * L, L]`` scores times ``[S, L, KVH, D]`` values.

    Returns the workspace layout ``[S * L, H, D]`` (row ``s * L + i``) in
    ``v.dtype``, ready for the caller's unpacking gather.
    """
    num_seqs, seq_len, num_kv_heads, head_size = v.shape
    groups = scores.shape[2] // seq_len
    probs = torch.softmax(scores, dim=-1).to(v.dtype)
    out = torch.matmul(probs, v.permute(0, 2, 1, 3))  # [S, KVH, G * L, D]
    out = out.view(num_seqs, num_kv_heads, groups, seq_len, head_size).permute(0, 3, 1, 2, 4)
    return out.reshape(num_seqs * seq_len, num_kv_heads * groups, head_size)


def encoder_fused(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """Fused attention of one unpadded sequence: ``[L, H, D]`` x ``[L, KVH, D]`` -> ``[L, H, D]``.

    Padded head dims are zeros in Q, K and V, so they change neither scores nor values.
    """
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1).unsqueeze(0),
        k.transpose(0, 1).unsqueeze(0),
        v.transpose(0, 1).unsqueeze(0),
        scale=scale,
        enable_gqa=q.shape[1] != k.shape[1],
    )
    return out.squeeze(0).transpose(0, 1)
