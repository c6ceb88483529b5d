"""The attention package's settings (entry point ``spyre_inference.settings: attention``).

The core collects them with every installed package's (``spyre_inference.platform.
settings.all_settings``) for ``settings.get``, start-up validation and the docs. The
backend's layout, ``SPYRE_ATTN_KV_LAYOUT``, is the core's: it picks among the
backends registered by name.
"""

from __future__ import annotations

from spyre_inference.platform.settings import (
    BOOL_CHOICES,
    Setting,
    int_list,
    parse_bool,
    positive_int,
)

SETTINGS: tuple[Setting, ...] = (
    Setting(
        "SPYRE_ATTN_RECORD",
        "1",
        "Pre-compile every attention kernel variant the bucketer can produce during "
        "warm-up (1), or compile each variant lazily on first use (0).",
        choices=BOOL_CHOICES,
        parse=parse_bool,
    ),
    Setting(
        "SPYRE_BATCHED_DECODE",
        "1",
        "Use the batched-decode attention kernel for decode-only sequences "
        "(token-major layout only).",
        choices=BOOL_CHOICES,
        parse=parse_bool,
    ),
    Setting(
        "SPYRE_ATTN_NUM_SEQS_BUCKETS",
        "",
        "Comma-separated num-sequences buckets for the batched-decode kernel. "
        "Empty: powers of two from 4 to max_num_seqs.",
        parse=int_list,
    ),
    Setting(
        "SPYRE_ATTN_MAX_CORES",
        "8",
        "Core cap for the head-major attention compile on the spyre target.",
        parse=positive_int,
    ),
    Setting(
        "SPYRE_CPU_ATTN_KERNEL",
        "auto",
        "cpu target: attention's host paths. `auto`: a decode batch attends through the "
        "plugin's AVX2 kernel, which reads the paged KV cache through the block table (built "
        "once with the system C compiler into `~/.cache/spyre-inference/kernels`) when the CPU "
        "has AVX2/FMA/F16C, a compiler exists and the layer has no soft-cap or ALiBi, and the "
        "token-major KV store runs eagerly; `graph`: both run as the compiled graphs the card "
        "runs.",
        choices=("auto", "graph"),
    ),
    Setting(
        "SPYRE_CPU_PREFILL_KERNEL",
        "auto",
        "cpu target: what a bfloat16 prefill chunk of 256 or more rows attends through (with "
        "`SPYRE_CPU_ATTN_KERNEL=auto`). `plugin`: the plugin's AVX-512 BF16 kernel "
        "(`csrc/paged_prefill.c`, built with the system C compiler; refused at start-up on a "
        "CPU without AVX-512 BF16); `torch`: PyTorch's CPU flash kernel; `auto`: the plugin's "
        "kernel on CPUs with AVX-512 BF16 and no AMX, PyTorch's elsewhere (with AMX, PyTorch's "
        "kernel can use the tile unit through oneDNN). Other dtypes always take PyTorch's.",
        choices=("auto", "plugin", "torch"),
    ),
)
