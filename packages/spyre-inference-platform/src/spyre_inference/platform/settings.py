"""Every environment variable of the plugin: declared by the package that reads it,
parsed once, validated at start-up.

The core declares its own settings here (:data:`SETTINGS`) and the types they are
made of; each sub-package declares its own in its ``settings`` module and
publishes them through the entry-point group :data:`ENTRY_POINT_GROUP`, which the
core collects (:func:`all_settings`) for :func:`get`, for start-up validation and
for the settings reference in ``docs/``. So a variable's name, type, default and
meaning live in one place, beside the code that reads it. An unknown value is a
start-up error that names the variable and lists what it accepts, rather than a
silent fallback to a default the user did not ask for.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import importlib.metadata
import logging
import os
from collections.abc import Callable, Mapping, Sequence
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


def parse_bool(raw: str) -> bool:
    return raw in ("1", "true", "yes", "on")


BOOL_CHOICES = ("0", "1", "false", "true", "no", "yes", "off", "on")

#: Every setting's name starts with it (torch-spyre's own variables do too).
PREFIX = "SPYRE_"


def positive_int(raw: str) -> int:
    value = int(raw)
    if value <= 0:
        raise ValueError("must be a positive integer")
    return value


def non_negative_int(raw: str) -> int:
    value = int(raw)
    if value < 0:
        raise ValueError("must be 0 or a positive integer")
    return value


def positive_float(raw: str) -> float:
    value = float(raw)
    if not value > 0:
        raise ValueError("must be a positive number")
    return value


def int_list(raw: str) -> tuple[int, ...]:
    """Comma-separated positive integers, '' meaning "derive from the config"."""
    if not raw:
        return ()
    values = tuple(sorted({positive_int(part.strip()) for part in raw.split(",")}))
    return values


def folder(raw: str) -> str:
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
        parse=positive_float,
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
        "up to max_num_batched_tokens, from 1 on the cpu target (decode steps of a few "
        "sequences run at their own size) with halfway buckets from 256 up (384, 768, "
        "...), and from 8 on the card's path.",
        parse=int_list,
    ),
    Setting(
        "SPYRE_SETTLED_GUARDS",
        "1",
        "After warm-up, run a compiled step with only the Dynamo guards that tell its "
        "cached graphs apart (`torch.compiler.set_stance(skip_guard_eval_unsafe=True)`) "
        "once its num_tokens bucket has served one step with full guards and compiled "
        "nothing (1), or evaluate every guard on every call (0).",
        choices=BOOL_CHOICES,
        parse=parse_bool,
    ),
    Setting(
        "SPYRE_DIRECT_BLOCK_CALLS",
        "1",
        "In a settled num_tokens bucket (see SPYRE_SETTLED_GUARDS), call each compiled "
        "block's graph through the Dynamo bytecode its arguments select, resolved once "
        "per call signature with full guards, instead of through torch.compile's "
        "wrapper and Dynamo's frame evaluation on every call (1); or always through "
        "torch.compile (0).",
        choices=BOOL_CHOICES,
        parse=parse_bool,
    ),
    Setting(
        "SPYRE_BUCKET_ALIGNED_PREFILL",
        "1",
        "With a compiled model and chunked prefill, cut a step's token budget at the "
        "num_tokens bucket below when a prompt's prefill would spill just past it (the "
        "rest runs next step beside the decodes) instead of padding the step to the next "
        "bucket (1); or schedule exactly as vLLM does (0). Only when no --scheduler-cls "
        "is given.",
        choices=BOOL_CHOICES,
        parse=parse_bool,
    ),
    Setting(
        "SPYRE_CPU_TCMALLOC",
        "auto",
        "cpu target: `auto` prepends tcmalloc (vLLM's bundled copy, else the system's "
        "libtcmalloc_minimal) to LD_PRELOAD for the engine processes started after the "
        "config check, as vLLM's CPU backend does; `off` leaves LD_PRELOAD alone.",
        choices=("auto", "off"),
    ),
    Setting(
        "SPYRE_SAMPLER",
        "candidates",
        "Random sampling on the host: `candidates` finds the tokens top-k/top-p keep "
        "among the most likely few (no vocabulary sort) and draws by inverse CDF; `vllm` "
        "runs vLLM's own PyTorch sampler (full sort, one exponential per vocabulary entry).",
        choices=("candidates", "vllm"),
    ),
    Setting(
        "SPYRE_ATTN_KV_LAYOUT",
        "token_major",
        "KV-cache page layout: `token_major` ([blocks, block_size, kv_heads, head]) "
        "or `head_major` ([blocks, kv_heads, block_size, head]).",
        choices=("token_major", "head_major"),
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
        "SPYRE_CPU_ISA",
        "auto",
        "cpu target: the instruction set the plugin's host kernels are built for. `auto` "
        "takes the widest this CPU runs and the kernel has a build for (the host GEMM and the "
        "decode-attention kernel: `avx512` on CPUs with AVX-512 F/BW/VL/DQ, else `avx2`; the "
        "prefill-attention kernel: `avx512bf16` only, on CPUs with AVX-512 BF16); a named one "
        "caps the choice (a kernel without a build up to it is unavailable) and one the CPU "
        "lacks is refused (never a silent fallback). The GEMM builds give identical bits; the "
        "decode-attention builds agree to float32 rounding.",
        choices=("auto", "avx2", "avx512", "avx512bf16"),
    ),
)

#: Entry-point group of the sub-packages' settings: each entry point loads to a
#: sequence of :class:`Setting`.
ENTRY_POINT_GROUP = "spyre_inference.settings"


@functools.cache
def all_settings() -> tuple[Setting, ...]:
    """The core's settings, then each installed sub-package's (by entry-point name).

    A sub-package that is not installed contributes nothing, so its variables are
    unknown, as its code is absent. Two declarations of one name are an error.
    """
    found: list[Setting] = list(SETTINGS)
    for ep in sorted(
        importlib.metadata.entry_points(group=ENTRY_POINT_GROUP), key=lambda e: e.name
    ):
        declared: Sequence[Setting] = ep.load()
        found.extend(declared)
    names = [s.name for s in found]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise RuntimeError(f"spyre-inference settings declared twice: {', '.join(twice)}")
    return tuple(found)


@functools.cache
def _by_name() -> dict[str, Setting]:
    return {s.name: s for s in all_settings()}


@functools.cache
def get(name: str) -> Any:
    """The parsed value of a plugin setting (cached: parsed once per process)."""
    try:
        setting = _by_name()[name]
    except KeyError:
        raise KeyError(
            f"{name} is not a setting of the installed spyre-inference packages"
        ) from None
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
    known = _by_name()
    found = {}
    for name in environ:
        if name.startswith(PREFIX) and name not in known:
            close = difflib.get_close_matches(name, known, n=1, cutoff=0.85)
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
    return {s.name: get(s.name) for s in all_settings()}


def reset_cache() -> None:
    """Forget parsed values (tests that change the environment call this)."""
    get.cache_clear()
