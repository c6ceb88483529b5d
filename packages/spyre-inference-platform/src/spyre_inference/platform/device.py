"""The one home of device placement: which device, which dtype, host<->device.

The plugin has three targets chosen once at start-up:

* ``spyre``: torch-spyre imports and a card is present. Compute is float16 only
  (the card has no bfloat16/float32 matmul path).
* ``cpu``: everything else. Same layer swaps, layouts, stick alignment,
  bucketing and compilation, computed on the host. bfloat16 by default
  (this class of CPU has fast bf16 GEMMs but no fast fp16 ones); float16 and
  float32 are accepted (float32 for exact comparisons with references).
* ``emulated``: the spyre target's code path on an emulated card
  (:mod:`~spyre_inference.platform.emulated_card`): a ``spyre`` device in host
  memory that refuses to mix with host tensors. Only when asked for by name.

:func:`is_spyre` means "runs the card's code path" (spyre and emulated);
:func:`has_card` is the real card only (its collective library, its compiler's
settings).

Every other package asks this module instead of deciding placement itself, so
the rules the card imposes (no int/bool tensors on device, floats in the
compute dtype) are enforced in one place on both targets.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import importlib
import importlib.util
from collections.abc import Callable
from typing import Any

import torch

from spyre_inference.platform import settings
from spyre_inference.platform.logs import get_logger
from spyre_inference.platform.native_build import cpu_flags

logger = get_logger(__name__)

#: Spyre moves data in 128-byte sticks; with a 2-byte element that is 64
#: elements. Every padded dimension (head size, MLP width, block size, encoder
#: sequence length) is a multiple of this on both targets.
STICK_BYTES = 128
STICK_ELEMS = 64


def round_up(value: int, multiple: int = STICK_ELEMS) -> int:
    return -(-value // multiple) * multiple


class DeviceTarget(enum.StrEnum):
    SPYRE = "spyre"
    CPU = "cpu"
    EMULATED = "emulated"


@dataclasses.dataclass(frozen=True)
class TargetChoice:
    target: DeviceTarget
    reason: str


def _count_cards() -> int:
    """Spyre cards torch-spyre sees on this host; raises if its runtime is broken."""
    importlib.import_module("torch_spyre")
    count_fn = getattr(getattr(torch, "spyre", None), "device_count", None)
    return int(count_fn()) if count_fn is not None else 0


def card_count() -> int:
    """Spyre cards on this host (0 without torch-spyre or with a broken runtime)."""
    if importlib.util.find_spec("torch_spyre") is None:
        return 0
    try:
        return max(_count_cards(), 0)
    except Exception:
        return 0


def _spyre_card_present() -> tuple[bool, str]:
    if importlib.util.find_spec("torch_spyre") is None:
        return False, "torch-spyre is not installed"
    try:
        count = _count_cards()
    except Exception as exc:  # a broken runtime is as good as no card
        return False, f"torch-spyre failed to import or count devices ({exc!r})"
    if count <= 0:
        return False, "torch-spyre is installed but no Spyre card is visible"
    return True, f"torch-spyre found {count} Spyre card(s)"


@functools.cache
def target_choice() -> TargetChoice:
    """Decide the device target once per process (logged once)."""
    requested = settings.get("SPYRE_DEVICE_TARGET")
    if requested == "emulated":
        from spyre_inference.platform import emulated_card

        emulated_card.install()
        choice = TargetChoice(DeviceTarget.EMULATED, "forced by SPYRE_DEVICE_TARGET=emulated")
        logger.info("spyre-inference device target: emulated (%s)", choice.reason)
        return choice
    present, why = _spyre_card_present() if requested != "cpu" else (False, "")
    if requested == "spyre":
        if not present:
            raise RuntimeError(
                f"SPYRE_DEVICE_TARGET=spyre but {why}. Install torch-spyre on a host "
                "with a Spyre card, or set SPYRE_DEVICE_TARGET=cpu (or auto)."
            )
        choice = TargetChoice(DeviceTarget.SPYRE, f"forced by SPYRE_DEVICE_TARGET; {why}")
    elif requested == "cpu":
        choice = TargetChoice(DeviceTarget.CPU, "forced by SPYRE_DEVICE_TARGET=cpu")
    elif present:
        choice = TargetChoice(DeviceTarget.SPYRE, why)
    else:
        choice = TargetChoice(DeviceTarget.CPU, why)
    logger.info("spyre-inference device target: %s (%s)", choice.target.value, choice.reason)
    return choice


def target() -> DeviceTarget:
    return target_choice().target


# The target queries below are constants of the process. Marked so for Dynamo:
# code it traces (a collective inside a block graph, a forward hook) then gets
# the answer instead of tracing into the cached first-call decision (which
# imports, builds and logs).
@torch._dynamo.assume_constant_result
def is_spyre() -> bool:
    """Whether this process runs the card's code path (a card or the emulated one)."""
    return target() is not DeviceTarget.CPU


@torch._dynamo.assume_constant_result
def has_card() -> bool:
    """Whether a real Spyre card (torch-spyre's runtime) is behind the device."""
    return target() is DeviceTarget.SPYRE


@torch._dynamo.assume_constant_result
def is_emulated() -> bool:
    return target() is DeviceTarget.EMULATED


def device() -> torch.device:
    """The compute device: ``spyre`` on the card path, ``cpu`` on the host target."""
    return torch.device("spyre") if is_spyre() else torch.device("cpu")


def compile_backend() -> str | Callable[..., Any]:
    """What ``torch.compile`` gets as its backend on this target.

    Inductor on the card (torch-spyre registers its code generator for the
    ``spyre`` device) and on the host; the emulated card's stand-in for
    torch-spyre's generator on the emulated target.
    """
    if is_emulated():
        from spyre_inference.platform import emulated_card

        return emulated_card.compile_backend
    return "inductor"


def device_memory_info() -> tuple[int, int]:
    """(free, total) bytes of the card's memory (card path only).

    Asked through ``torch.accelerator`` (the device's allocator; the emulated
    card's reports its own accounting), else torch-spyre's device module as
    ``torch.cuda.mem_get_info``.
    """
    if not is_spyre():
        raise RuntimeError("device_memory_info() is for the card path; the cpu target is the host")
    try:
        free, total = torch.accelerator.get_memory_info()
        return int(free), int(total)
    except (RuntimeError, NotImplementedError):
        pass
    info = getattr(getattr(torch, "spyre", None), "mem_get_info", None)
    if info is None:
        raise RuntimeError(
            "torch-spyre does not report the card's memory (torch.accelerator."
            "get_memory_info, torch.spyre.mem_get_info); pass --kv-cache-memory-bytes "
            "to size the KV cache"
        )
    free, total = info()
    return int(free), int(total)


def allowed_dtypes(for_target: DeviceTarget | None = None) -> tuple[torch.dtype, ...]:
    """Compute dtypes of a target (default: this process's), the default first."""
    if (for_target or target()) is not DeviceTarget.CPU:
        return (torch.float16,)
    return (torch.bfloat16, torch.float16, torch.float32)


def default_dtype() -> torch.dtype:
    return allowed_dtypes()[0]


@dataclasses.dataclass
class TransferCounters:
    """Host<->device conversions the card makes, a cost proxy that predicts its cost.

    Counted on both targets. On the cpu target nothing moves, so a conversion is
    counted where the card would make one: every :func:`to_device` call (callers
    hand it host tensors), every :func:`to_host` of a floating-point tensor (only
    floats are computed on the device; integer tensors are host bookkeeping on
    both targets) and :func:`note_transfer` for the conversions the cpu target
    skips outright.
    """

    h2d: int = 0
    d2h: int = 0

    def reset(self) -> None:
        self.h2d = 0
        self.d2h = 0


transfers = TransferCounters()


def note_transfer(direction: str) -> None:
    """Count a conversion the cpu target skips (``"h2d"`` or ``"d2h"``)."""
    setattr(transfers, direction, getattr(transfers, direction) + 1)


def placeable_on_device(dtype: torch.dtype) -> bool:
    """Whether the card holds tensors of ``dtype``: floats, and int64 / int32 as
    gather and scatter indices; never bool or small integers (spec: no int/bool
    tensors on the device beyond indices)."""
    if dtype.is_floating_point:
        return True
    return dtype in (torch.int64, torch.int32)


def to_device(t: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """Place a host tensor for device compute.

    Int/bool tensors are converted to int64 for the embedding gather; Spyre has
    no int32/bool compute, so index tensors either stay on the host or travel as
    int64. Floats move in ``dtype`` (default: unchanged).
    """
    dev = device()
    if t.device == dev and (dtype is None or t.dtype == dtype):
        if dev.type == "cpu":
            transfers.h2d += 1  # the card would copy this host tensor
        return t
    transfers.h2d += 1
    return t.to(device=dev, dtype=dtype)


def to_host(t: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """Bring a device tensor back to the host (a no-op copy-wise on cpu)."""
    if t.device.type == "cpu" and (dtype is None or t.dtype == dtype):
        if not is_spyre() and t.dtype.is_floating_point:
            transfers.d2h += 1  # computed on the device on the card
        return t
    transfers.d2h += 1
    return t.to(device="cpu", dtype=dtype)


# ---- host GEMMs (cpu target) ------------------------------------------------


#: x86 CPU flags (as /proc/cpuinfo spells them) of bfloat16/float16 matrix
#: instructions: with one of them oneDNN computes a 16-bit GEMM natively.
FAST_GEMM_FLAGS: dict[torch.dtype, tuple[str, ...]] = {
    torch.bfloat16: ("avx512_bf16", "amx_bf16"),
    torch.float16: ("avx512_fp16", "amx_fp16"),
}


def has_fast_16bit_gemm(dtype: torch.dtype) -> bool:
    """Whether torch's own GEMM is fast for ``dtype`` on this host.

    On x86 this is decided by the CPU's instructions, not by oneDNN's
    ``_is_mkldnn_bf16_supported``: that is true on every AVX-512 CPU because
    oneDNN *runs* bfloat16 there, by widening in software, and measured on an
    Ice Lake Xeon (AVX-512 without BF16) its bfloat16 product of a decode row
    was 3-4x slower than the plugin's host kernel. Elsewhere (aarch64) oneDNN's
    own check is used.
    """
    flags = cpu_flags()
    if "avx2" in flags or "avx512f" in flags:
        return any(f in flags for f in FAST_GEMM_FLAGS[dtype])
    mkldnn = torch.ops.mkldnn
    if dtype == torch.bfloat16:
        return bool(mkldnn._is_mkldnn_bf16_supported())
    return bool(mkldnn._is_mkldnn_fp16_supported())


@functools.cache
def host_gemm_dtype(dtype: torch.dtype) -> torch.dtype | None:
    """The dtype the cpu target's matmuls with ``dtype`` weights compute in, or None (as is).

    CPUs without bfloat16/float16 matrix instructions (AVX2-only x86, for
    example) have no fast reduced-precision GEMM in PyTorch: oneDNN refuses the
    type and ATen's fallback loops are 10-100x slower than its float32 GEMM
    (measured on a 2-core AVX2 EPYC: a bfloat16 ``[8, 576] @ [576, 3072]`` took
    39 ms, the same product in float32 1.6 ms). There the matmuls compute in
    float32: every bfloat16/float16 value is exact in float32 and the products
    accumulate in float32, as a bfloat16 GEMM with float32 accumulation does,
    so results agree with it up to summation order. The ops package decides
    how (its AVX2 host kernel on the 16-bit weights, else float32 copies;
    ``SPYRE_CPU_GEMM_KERNEL``). The card and CPUs with the instructions keep
    ``dtype``.
    ``SPYRE_CPU_GEMM_DTYPE`` overrides the detection.
    """
    if is_spyre() or dtype not in (torch.bfloat16, torch.float16):
        return None
    choice = settings.get("SPYRE_CPU_GEMM_DTYPE")
    if choice == "model":
        return None
    if choice == "float32":
        return torch.float32
    if has_fast_16bit_gemm(dtype):
        return None
    logger.info(
        "cpu target: this CPU has no fast %s GEMM; matmuls compute in float32 "
        "(SPYRE_CPU_GEMM_DTYPE=model keeps %s).",
        dtype,
        dtype,
    )
    return torch.float32


def reset_for_tests() -> None:
    target_choice.cache_clear()
    host_gemm_dtype.cache_clear()
    settings.reset_cache()
