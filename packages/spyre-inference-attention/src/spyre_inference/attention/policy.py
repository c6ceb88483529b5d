"""When the attention kernels compile, and how they tile (one place for the rules).

* Decoder and encoder kernels compile (``dynamic=False``, one graph per
  bucket) whenever the model itself compiles, i.e. unless ``--enforce-eager``;
  under ``--enforce-eager`` they run the same functions eagerly.
* The head-major kernels always compile (spec, "LX-resident pages": their 2-D
  page gather lowers to ``aten.index``, which fails eagerly on the card by
  upcasting its int32 index). Attention compiles in its own domain, so the
  rest of the model still runs eagerly.
* The KV store compiles only when the model does: only then is the step's
  token count padded onto the runner's buckets, which bounds its variants.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

from spyre_inference.platform import device as placement
from spyre_inference.platform import settings

if TYPE_CHECKING:
    from vllm.config import VllmConfig

#: On the cpu target a tile of the online softmax covers up to this many
#: tokens of one sequence (the card reads one page per tile, as the spec says).
CPU_TILE_TOKENS = 1024
#: ... and up to this many tokens summed over a batched-decode tile, which
#: bounds the gathered K/V of a tile at large batch sizes.
CPU_DECODE_TILE_TOKENS = 16384


def model_compiles(vllm_config: VllmConfig) -> bool:
    """Whether the runner compiles the model (and pads num_tokens onto buckets)."""
    from vllm.config import CompilationMode

    return vllm_config.compilation_config.mode != CompilationMode.NONE


def pages_per_tile(block_size: int, num_seqs: int = 1) -> int:
    """Pages read per step of the online softmax.

    One on the card (the spec's page-at-a-time walk); on the cpu target as many
    as fit :data:`CPU_TILE_TOKENS` per sequence and
    :data:`CPU_DECODE_TILE_TOKENS` over a batch.
    """
    if placement.is_spyre():
        return 1
    budget = min(CPU_TILE_TOKENS, CPU_DECODE_TILE_TOKENS // max(1, num_seqs))
    return max(1, budget // block_size)


def batched_decode_requested() -> bool:
    return bool(settings.get("SPYRE_BATCHED_DECODE"))


def explicitly_set(name: str) -> bool:
    """Whether the user set a plugin setting, as opposed to leaving its default.

    The batched-decode kernel is on by default, but only on the token-major
    layout: the head-major backend ignores the default and refuses an explicit
    request. Reading the raw variable only answers "was it given"; its value
    still comes from :mod:`spyre_inference.platform.settings`.
    """
    settings.get(name)  # a known setting, with a valid value
    return name in os.environ


def num_seqs_buckets_setting() -> tuple[int, ...]:
    return tuple(settings.get("SPYRE_ATTN_NUM_SEQS_BUCKETS"))


def record_at_warm_up() -> bool:
    return bool(settings.get("SPYRE_ATTN_RECORD"))
