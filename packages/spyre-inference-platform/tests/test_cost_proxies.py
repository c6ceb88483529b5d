"""Host<->device conversion counters on the cpu target (a cost proxy of the card).

Nothing moves on the cpu target, yet the counters must count what the card
would convert: every host tensor placed for device compute, every float
tensor brought back (integer tensors are host bookkeeping on both targets).
"""

from __future__ import annotations

import pytest
import torch

from spyre_inference.platform import device as dev


@pytest.fixture
def cpu_target(monkeypatch):
    monkeypatch.setenv("SPYRE_DEVICE_TARGET", "cpu")
    dev.reset_for_tests()
    dev.transfers.reset()
    yield
    dev.reset_for_tests()


def test_conversions_are_counted_without_copies(cpu_target):
    host = torch.arange(4)
    assert dev.to_device(host) is host
    floats = torch.ones(3)
    assert dev.to_device(floats) is floats
    assert (dev.transfers.h2d, dev.transfers.d2h) == (2, 0)
    assert dev.to_host(floats) is floats
    assert dev.to_host(host) is host  # integer: host bookkeeping, no conversion
    assert (dev.transfers.h2d, dev.transfers.d2h) == (2, 1)
    dev.note_transfer("h2d")
    assert dev.transfers.h2d == 3
    dev.transfers.reset()
    assert (dev.transfers.h2d, dev.transfers.d2h) == (0, 0)


@pytest.mark.parametrize(
    ("setting", "dtype", "expected"),
    [
        ("float32", torch.bfloat16, torch.float32),
        ("float32", torch.float16, torch.float32),
        ("float32", torch.float32, None),
        ("model", torch.bfloat16, None),
    ],
)
def test_host_gemm_dtype_setting(cpu_target, monkeypatch, setting, dtype, expected):
    monkeypatch.setenv("SPYRE_CPU_GEMM_DTYPE", setting)
    dev.reset_for_tests()
    assert dev.host_gemm_dtype(dtype) == expected


def _x86_flags() -> set[str]:
    """The CPU's flags as /proc/cpuinfo lists them (empty off x86 Linux)."""
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def test_host_gemm_dtype_auto_follows_the_cpu(cpu_target):
    """auto: the model dtype only where the CPU has bfloat16/float16 matrix
    instructions (x86: AVX512_BF16 or AMX_BF16; AVX512_FP16 or AMX_FP16). oneDNN's
    own check is not the rule on x86: it is true on every AVX-512 CPU, where it
    widens bfloat16 in software (slower than the host kernel)."""
    flags = _x86_flags()
    if "avx2" not in flags:
        pytest.skip("not an x86 CPU with AVX2: oneDNN's own check decides")
    bf16 = bool(flags & {"avx512_bf16", "amx_bf16"})
    fp16 = bool(flags & {"avx512_fp16", "amx_fp16"})
    assert dev.host_gemm_dtype(torch.bfloat16) == (None if bf16 else torch.float32)
    assert dev.host_gemm_dtype(torch.float16) == (None if fp16 else torch.float32)
