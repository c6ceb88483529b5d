"""The ops package's settings (entry point ``spyre_inference.settings: ops``).

The core collects them with every installed package's (``spyre_inference.platform.
settings.all_settings``) for ``settings.get``, start-up validation and the docs. The
GEMM dtype (``SPYRE_CPU_GEMM_DTYPE``) is the core's: its device module decides it for
every package.
"""

from __future__ import annotations

from spyre_inference.platform.settings import BOOL_CHOICES, Setting, non_negative_int, parse_bool

#: ``SPYRE_CPU_GEMM_HOST_ROWS=auto``: the largest product (rows) the host GEMM kernel
#: serves in place of oneDNN. Measured on a 2-core AMD Zen 4 (AVX-512 BF16), SmolLM2's
#: 120 decode GEMMs per step, weights cycled through DRAM, host kernel / oneDNN on
#: prepacked weights: 1 row 0.84, 2 rows 0.86, 3 rows 0.99, 4 rows 1.10
#: (``benchmarks/sxs/analysis/amd-avx512-bf16.md``, stop 32).
AUTO_HOST_ROWS = 2


def host_rows(raw: str) -> int:
    """``auto`` -> :data:`AUTO_HOST_ROWS`, else a row count (0: oneDNN throughout)."""
    return AUTO_HOST_ROWS if raw.lower() == "auto" else non_negative_int(raw)


SETTINGS: tuple[Setting, ...] = (
    Setting(
        "SPYRE_CPU_GEMM_KERNEL",
        "auto",
        "cpu target, where matmuls with bfloat16/float16 weights compute in float32 (see "
        "SPYRE_CPU_GEMM_DTYPE): how. `auto` uses the plugin's AVX2 kernel, which reads the "
        "16-bit `[in, out]` weights directly (built once with the system C compiler into "
        "`~/.cache/spyre-inference/kernels`), when the CPU has AVX2/FMA/F16C and a compiler "
        "exists, else float32 weight copies and torch's GEMM; `torch` always uses the copies. "
        "The same switch governs INT8 W8A8 products of up to 4 rows (decode steps): `auto` "
        "runs the plugin's INT8 kernel (exact, equal to `torch._int_mm`), `torch` oneDNN's.",
        choices=("auto", "torch"),
    ),
    Setting(
        "SPYRE_CPU_GEMM_PACK",
        "auto",
        "cpu target, where matmuls with bfloat16/float16 weights keep the model dtype (see "
        "SPYRE_CPU_GEMM_DTYPE): `auto` gives every transposed linear weight a copy prepacked "
        "for oneDNN at load and runs the layers through it (what vLLM's CPU backend does; "
        "1.5-2x faster GEMMs, one more copy of the weights in host memory); `off` runs "
        "torch's matmul on the `[in, out]` weight alone.",
        choices=("auto", "off"),
    ),
    Setting(
        "SPYRE_CPU_INT8_VOCAB",
        "0",
        "cpu target: keep the vocabulary matrix (the LM head and the input embedding; one "
        "matrix when they are tied) in INT8 with a float32 scale per vocabulary row, "
        "quantized at load, and compute the logits with an INT8 GEMM on per-token INT8 "
        "activations (1). Halves the largest weight of small models and the bytes the head "
        "reads per token; the logits move by the quantization error (top tokens can swap "
        "where they are near-ties). Not with LoRA or weight reloading; refused on the card "
        "path.",
        choices=BOOL_CHOICES,
        parse=parse_bool,
    ),
    Setting(
        "SPYRE_CPU_GEMM_HOST_ROWS",
        "auto",
        "cpu target, with SPYRE_CPU_GEMM_PACK=auto: products of at most this many rows "
        "(a decode step of that many sequences) run on the plugin's host GEMM kernel on "
        "the `[in, out]` weight instead of oneDNN, whose fixed cost per call dominates "
        "there; 0 sends every product to oneDNN; `auto` (2) is where the host kernel "
        "measured faster on SmolLM2's decode GEMMs. Needs the C++ linear op (a C++ "
        "compiler, ninja and torch's headers); the choice is logged at load.",
        parse=host_rows,
    ),
)
