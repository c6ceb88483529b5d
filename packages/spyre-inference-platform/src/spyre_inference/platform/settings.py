"""Every environment variable of the plugin, parsed once.

All sub-packages read their settings from here so that there is exactly one
place that knows a variable's name, type, default and meaning; the settings
reference in ``docs/`` is generated from :data:`SETTINGS`. An unknown value is
a start-up error that names the variable and lists what it accepts, rather than
a silent fallback to a default the user did not ask for.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import logging
import os
from collections.abc import Callable, Mapping
from typing import Any

# Inside vLLM's logger tree (see platform.logs) without importing vLLM here.
logger = logging.getLogger(f"vllm.{__name__}")


class SettingError(ValueError):
    """A plugin environment variable holds a value the plugin cannot use."""


@dataclasses.dataclass(frozen=True)
class Setting:
    """One environment variable: how to parse it and what it means."""

    name: str
    default: str
    doc: str
    choices: tuple[str, ...] | None = None
    parse: Callable[[str], Any] = str

    def read(self) -> Any:
        raw = os.environ.get(self.name, self.default).strip()
        if self.choices is not None and raw.lower() not in self.choices:
            raise SettingError(
                f"{self.name}={raw!r} is not a valid value; "
                f"use one of {', '.join(self.choices)} (default {self.default!r})."
            )
        try:
            return self.parse(raw.lower() if self.choices is not None else raw)
        except (TypeError, ValueError) as exc:
            raise SettingError(
                f"{self.name}={raw!r} cannot be parsed: {exc}. "
                f"Unset it to use the default {self.default!r}."
            ) from exc


def _bool(raw: str) -> bool:
    return raw in ("1", "true", "yes", "on")


_BOOL_CHOICES = ("0", "1", "false", "true", "no", "yes", "off", "on")

#: Every setting's name starts with it (torch-spyre's own variables do too).
PREFIX = "SPYRE_"


def _positive_int(raw: str) -> int:
    value = int(raw)
    if value <= 0:
        raise ValueError("must be a positive integer")
    return value


def _non_negative_int(raw: str) -> int:
    value = int(raw)
    if value < 0:
        raise ValueError("must be 0 or a positive integer")
    return value


def _positive_float(raw: str) -> float:
    value = float(raw)
    if not value > 0:
        raise ValueError("must be a positive number")
    return value


def _int_list(raw: str) -> tuple[int, ...]:
    """Comma-separated positive integers, '' meaning "derive from the config"."""
    if not raw:
        return ()
    values = tuple(sorted({_positive_int(part.strip()) for part in raw.split(",")}))
    return values


def _folder(raw: str) -> str:
    """A folder path ('' meaning "the default"); an existing file is refused."""
    path = os.path.expanduser(raw)
    if raw and os.path.exists(path) and not os.path.isdir(path):
        raise ValueError("it is a file, not a folder")
    return raw


SETTINGS: tuple[Setting, ...] = (
    Setting(
        "SPYRE_DEVICE_TARGET",
        "auto",
        "Which device the plugin computes on. `auto` picks `spyre` when torch-spyre "
        "imports and a card is present, else `cpu`; `spyre` fails at start-up "
        "without a card; `cpu` forces the host target (same layouts, bucketing "
        "and compilation, computed on the CPU); `emulated` runs the spyre target's "
        "code path on an emulated card in host memory (float16, a device type of "
        "its own that refuses to mix with host tensors; never chosen by `auto`).",
        choices=("auto", "spyre", "cpu", "emulated"),
    ),
    Setting(
        "SPYRE_EMULATED_DEVICE_MEMORY_GB",
        "4",
        "emulated target: the emulated card's device memory in GiB. Allocations are "
        "charged against it and the KV budget is computed from it, as on a card; it "
        "lives in host RAM, so keep it below the host's free memory.",
        parse=_positive_float,
    ),
    Setting(
        "SPYRE_COMPILE_GRANULARITY",
        "block",
        "What torch.compile wraps under STOCK_TORCH_COMPILE: `block` compiles each "
        "decoder/encoder block in place (compile cost independent of depth); "
        "`model` compiles the whole model as one graph.",
        choices=("block", "model"),
    ),
    Setting(
        "SPYRE_NUM_TOKENS_BUCKETS",
        "",
        "Comma-separated packed num_tokens buckets for the block graphs; "
        "max_num_batched_tokens is always added as the largest. Empty: powers of two "
        "from 8 up to max_num_batched_tokens.",
        parse=_int_list,
    ),
    Setting(
        "SPYRE_SETTLED_GUARDS",
        "1",
        "After warm-up, run a compiled step with only the Dynamo guards that tell its "
        "cached graphs apart (`torch.compiler.set_stance(skip_guard_eval_unsafe=True)`) "
        "once its num_tokens bucket has served one step with full guards and compiled "
        "nothing (1), or evaluate every guard on every call (0).",
        choices=_BOOL_CHOICES,
        parse=_bool,
    ),
    Setting(
        "SPYRE_ATTN_KV_LAYOUT",
        "token_major",
        "KV-cache page layout: `token_major` ([blocks, block_size, kv_heads, head]) "
        "or `head_major` ([blocks, kv_heads, block_size, head]).",
        choices=("token_major", "head_major"),
    ),
    Setting(
        "SPYRE_ATTN_RECORD",
        "1",
        "Pre-compile every attention kernel variant the bucketer can produce during "
        "warm-up (1), or compile each variant lazily on first use (0).",
        choices=_BOOL_CHOICES,
        parse=_bool,
    ),
    Setting(
        "SPYRE_BATCHED_DECODE",
        "1",
        "Use the batched-decode attention kernel for decode-only sequences "
        "(token-major layout only).",
        choices=_BOOL_CHOICES,
        parse=_bool,
    ),
    Setting(
        "SPYRE_ATTN_NUM_SEQS_BUCKETS",
        "",
        "Comma-separated num-sequences buckets for the batched-decode kernel. "
        "Empty: powers of two from 4 to max_num_seqs.",
        parse=_int_list,
    ),
    Setting(
        "SPYRE_ATTN_MAX_CORES",
        "8",
        "Core cap for the head-major attention compile on the spyre target.",
        parse=_positive_int,
    ),
    Setting(
        "SPYRE_CPU_GEMM_DTYPE",
        "auto",
        "cpu target: the dtype matmuls with bfloat16/float16 weights compute in. `auto` "
        "uses float32 (how: SPYRE_CPU_GEMM_KERNEL) when the CPU has no fast "
        "bfloat16/float16 GEMM (no AVX-512 BF16/FP16 or AMX), else the model dtype; "
        "`model` always keeps the model dtype; `float32` always uses float32.",
        choices=("auto", "model", "float32"),
    ),
    Setting(
        "SPYRE_CPU_GEMM_KERNEL",
        "auto",
        "cpu target, where matmuls with bfloat16/float16 weights compute in float32 (see "
        "SPYRE_CPU_GEMM_DTYPE): how. `auto` uses the plugin's AVX2 kernel, which reads the "
        "16-bit `[in, out]` weights directly (built once with the system C compiler into "
        "`~/.cache/spyre-inference/kernels`), when the CPU has AVX2/FMA/F16C and a compiler "
        "exists, else float32 weight copies and torch's GEMM; `torch` always uses the copies.",
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
        choices=_BOOL_CHOICES,
        parse=_bool,
    ),
    Setting(
        "SPYRE_CPU_GEMM_HOST_ROWS",
        "0",
        "cpu target, with SPYRE_CPU_GEMM_PACK=auto: products of at most this many rows "
        "(a decode step of that many sequences) run on the plugin's host GEMM kernel on "
        "the `[in, out]` weight instead of oneDNN, whose fixed cost per call dominates "
        "there; 0 sends every product to oneDNN. Needs the C++ linear op (a C++ compiler, "
        "ninja and torch's headers).",
        parse=_non_negative_int,
    ),
    Setting(
        "SPYRE_CPU_ISA",
        "auto",
        "cpu target: the instruction set the plugin's host kernels are built for. `auto` "
        "takes the widest this CPU runs and the kernel has a build for (the host GEMM and the "
        "decode-attention kernel: `avx512` on CPUs with AVX-512 F/BW/VL/DQ, else `avx2`); a "
        "named one is used or the kernel is unavailable (never a silent fallback). The GEMM "
        "builds give identical bits; the attention builds agree to float32 rounding.",
        choices=("auto", "avx2", "avx512"),
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
        "SPYRE_DEFAULT_MODEL_DIR",
        "",
        "Folder of the embedded default model (SmolLM2-135M-Instruct converted to a "
        "dense checkpoint by `spyre-prepare-default-model`). Empty: "
        "`$XDG_CACHE_HOME/spyre-inference/models/smollm2-135m-instruct` "
        "(`~/.cache/...` when XDG_CACHE_HOME is unset).",
        parse=_folder,
    ),
)

_BY_NAME = {s.name: s for s in SETTINGS}


@functools.cache
def get(name: str) -> Any:
    """The parsed value of a plugin setting (cached: parsed once per process)."""
    try:
        setting = _BY_NAME[name]
    except KeyError:
        raise KeyError(f"{name} is not a spyre-inference setting") from None
    return setting.read()


def is_set(name: str) -> bool:
    """Whether the user set ``name`` (a known setting, with a valid value) rather
    than leaving its default."""
    get(name)
    return name in os.environ


def misspelled(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """``SPYRE_*`` variables that are not settings but nearly spell one: name -> setting.

    Only near misses are reported: torch-spyre and the project's tools read
    ``SPYRE_*`` variables of their own, which are not typos.
    """
    environ = os.environ if environ is None else environ
    found = {}
    for name in environ:
        if name.startswith(PREFIX) and name not in _BY_NAME:
            close = difflib.get_close_matches(name, _BY_NAME, n=1, cutoff=0.85)
            if close:
                found[name] = close[0]
    return found


def validate_all() -> dict[str, Any]:
    """Parse every setting now so a bad value fails start-up, not a request; warn
    about a variable that looks like a misspelled setting (it would be ignored)."""
    for name, setting in sorted(misspelled().items()):
        logger.warning(
            "%s is not a spyre-inference setting and is ignored; did you mean %s?",
            name,
            setting,
        )
    return {s.name: get(s.name) for s in SETTINGS}


def reset_cache() -> None:
    """Forget parsed values (tests that change the environment call this)."""
    get.cache_clear()
