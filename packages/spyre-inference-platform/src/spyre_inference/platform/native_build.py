"""Build and load the cpu target's small C kernels (host GEMM, decode attention).

The cpu target replaces a few PyTorch paths that are slow on CPUs without
16-bit matrix instructions with small C kernels of the plugin's packages. They
need no torch headers: each is one C file built with the system C compiler in
about a second, cached per machine under ``cache_root()/kernels`` by a hash of
its source, flags and compiler, and loaded with ctypes. One place builds them
so every package finds the same cache and gives the same reasons when a host
cannot have them.

A kernel source may have builds for more than one instruction set
(:data:`ISAS`): the build is chosen once per process from the CPU's flags, the
widest the source supports, or forced with ``SPYRE_CPU_ISA`` (tests force each
one). The C files keep the arithmetic per output element the same in every
build, so the choice changes speed, never results.
"""

from __future__ import annotations

import ctypes
import dataclasses
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import types
from collections.abc import Sequence
from pathlib import Path

from spyre_inference.platform import settings
from spyre_inference.platform.cache_dir import cache_root

#: Flags every kernel is built with: AVX2/FMA/F16C code, OpenMP (libgomp, the
#: runtime torch's CPU wheels already load, so there is one thread pool).
AVX2_CFLAGS: tuple[str, ...] = (
    "-O3",
    "-mavx2",
    "-mfma",
    "-mf16c",
    "-fopenmp",
    "-fPIC",
    "-shared",
)
#: CPU flags :data:`AVX2_CFLAGS` require (as /proc/cpuinfo spells them).
AVX2_CPU_FLAGS: tuple[str, ...] = ("avx2", "fma", "f16c")
#: AVX-512 builds add these (F, BW, VL, DQ: what the kernels' 16-wide loads,
#: widening conversions and 256-bit EVEX forms use; every AVX-512 server CPU
#: since Skylake-SP has them).
AVX512_CFLAGS: tuple[str, ...] = (
    *AVX2_CFLAGS,
    "-mavx512f",
    "-mavx512bw",
    "-mavx512vl",
    "-mavx512dq",
)
AVX512_CPU_FLAGS: tuple[str, ...] = (*AVX2_CPU_FLAGS, "avx512f", "avx512bw", "avx512vl", "avx512dq")
#: AVX-512 with the bfloat16 dot product (VDPBF16PS: Cooper Lake, Sapphire
#: Rapids and later Xeons, AMD Zen 4 and later), for kernels that multiply
#: 16-bit values without widening them first.
AVX512BF16_CFLAGS: tuple[str, ...] = (*AVX512_CFLAGS, "-mavx512bf16")
AVX512BF16_CPU_FLAGS: tuple[str, ...] = (*AVX512_CPU_FLAGS, "avx512_bf16")


@dataclasses.dataclass(frozen=True)
class Isa:
    """An instruction set a kernel can be built for."""

    name: str
    cpu_flags: tuple[str, ...]
    cflags: tuple[str, ...]


#: Instruction sets, widest first.
ISAS: tuple[Isa, ...] = (
    Isa("avx512bf16", AVX512BF16_CPU_FLAGS, AVX512BF16_CFLAGS),
    Isa("avx512", AVX512_CPU_FLAGS, AVX512_CFLAGS),
    Isa("avx2", AVX2_CPU_FLAGS, AVX2_CFLAGS),
)
_ISA_BY_NAME = {isa.name: isa for isa in ISAS}


class NativeKernelUnavailable(RuntimeError):
    """A kernel cannot be built or run on this host; the message says why."""


@functools.cache
def cpu_flags() -> frozenset[str]:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("flags"):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def kernel_cache_dir() -> Path:
    return cache_root() / "kernels"


def c_compiler() -> str | None:
    """``$CC``, else the first of cc, gcc, clang on PATH."""
    for name in (os.environ.get("CC"), "cc", "gcc", "clang"):
        if name and shutil.which(name):
            return name
    return None


def build(source: Path, cflags: Sequence[str] = AVX2_CFLAGS) -> Path:
    """The shared library of ``source``, compiled unless this exact build exists."""
    cc = c_compiler()
    if cc is None:
        raise NativeKernelUnavailable("no C compiler found (set CC, or install gcc)")
    text = source.read_bytes()
    key = hashlib.sha256(text + " ".join(cflags).encode() + cc.encode()).hexdigest()[:16]
    out = kernel_cache_dir() / f"{source.stem}-{key}-{platform.machine()}.so"
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    # Build to a private name and rename: concurrent builders (tensor-parallel
    # workers starting together) each produce a complete file, and the rename
    # is atomic, so no process ever loads a half-written library.
    fd, tmp = tempfile.mkstemp(dir=out.parent, suffix=".so.tmp")
    os.close(fd)
    try:
        proc = subprocess.run(
            [cc, *cflags, "-o", tmp, str(source)],
            capture_output=True,
            text=True,
            check=False,
        )
        if proc.returncode != 0:
            raise NativeKernelUnavailable(
                f"building {source.name} with {cc} failed: {proc.stderr.strip()[-2000:]}"
            )
        os.replace(tmp, out)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return out


def _missing(isa: Isa) -> list[str]:
    return [f for f in isa.cpu_flags if f not in cpu_flags()]


def select_isa(supported: Sequence[str]) -> Isa:
    """The instruction set a kernel with builds for ``supported`` uses on this host.

    ``SPYRE_CPU_ISA=auto`` takes the widest build the CPU runs. A named ISA
    caps the choice: the widest build up to it (a kernel with an AVX2 build
    only stays AVX2 under ``avx512``); naming one the CPU cannot run makes the
    kernels unavailable with that reason (a forced choice never silently falls
    back to another).
    """
    if platform.machine() not in ("x86_64", "AMD64"):
        raise NativeKernelUnavailable(
            f"the kernels are x86-64 only (this host: {platform.machine()})"
        )
    candidates = list(ISAS)
    forced = settings.get("SPYRE_CPU_ISA")
    if forced != "auto":
        cap = _ISA_BY_NAME[forced]
        missing = _missing(cap)
        if missing:
            raise NativeKernelUnavailable(
                f"SPYRE_CPU_ISA={forced}: the CPU lacks {', '.join(missing)}"
            )
        candidates = candidates[candidates.index(cap) :]
    candidates = [isa for isa in candidates if isa.name in supported]
    for isa in candidates:
        if not _missing(isa):
            return isa
    if not candidates:
        cap = "" if forced == "auto" else f" up to SPYRE_CPU_ISA={forced}"
        raise NativeKernelUnavailable(
            f"this kernel has no build{cap} (it has {', '.join(supported)})"
        )
    raise NativeKernelUnavailable(f"the CPU lacks {', '.join(_missing(candidates[-1]))}")


def load_kernel(source: Path, supported: Sequence[str] = ("avx2",)) -> tuple[ctypes.CDLL, str]:
    """Build ``source`` for :func:`select_isa`'s choice, load it; (library, ISA name)."""
    isa = select_isa(supported)
    return ctypes.CDLL(str(build(source, isa.cflags))), isa.name


def load_torch_extension(
    source: Path, *, python_module: bool = True, cflags: Sequence[str] = ("-O2",)
) -> types.ModuleType | None:
    """Build (once per machine and torch version) and load a C++ file using torch's headers.

    For kernels that must be torch operators (a ``TORCH_LIBRARY`` registration
    the dispatcher calls without Python) or a device backend: unlike the C
    kernels above they need a C++ compiler, ninja and torch's headers, and a
    first build takes tens of seconds. ``python_module=False`` loads the library
    for its registrations only (returns None). Raises
    :class:`NativeKernelUnavailable` saying what is missing.
    """
    import torch
    from torch.utils.cpp_extension import load

    text = source.read_bytes()
    # One build per source text, torch installation and flags. The installation's
    # path is part of the key because ninja rebuilds whenever the compile command
    # changes, and the command names that torch's include directories: builds
    # from several venvs sharing one directory rebuilt each other in turn (every
    # nox session of a CI run paid 15-40 s per library).
    torch_home = str(Path(torch.__file__).resolve().parent)
    key = hashlib.sha256(
        text + torch.__version__.encode() + torch_home.encode() + " ".join(cflags).encode()
    ).hexdigest()[:12]
    name = f"spyre_{source.stem}_{key}"
    build_dir = kernel_cache_dir() / f"{source.stem}-{key}"
    build_dir.mkdir(parents=True, exist_ok=True)
    # Compiled from a copy in the build directory, written once: the installed
    # file's path and mtime change with every reinstall, and ninja rebuilds for
    # either.
    staged = build_dir / source.name
    if not staged.exists():
        partial = build_dir / f".{source.name}.{os.getpid()}"
        partial.write_bytes(text)
        os.replace(partial, staged)
    try:
        return load(
            name=name,
            sources=[str(staged)],
            extra_cflags=list(cflags),
            build_directory=str(build_dir),
            is_python_module=python_module,
            verbose=False,
        )
    except Exception as exc:  # a compiler or header problem: say what is missing
        raise NativeKernelUnavailable(
            f"{source.name} could not be built ({exc}); it needs a C++ compiler, ninja "
            "and torch's headers"
        ) from exc


__all__ = [
    "AVX2_CFLAGS",
    "AVX2_CPU_FLAGS",
    "AVX512BF16_CFLAGS",
    "AVX512BF16_CPU_FLAGS",
    "AVX512_CFLAGS",
    "AVX512_CPU_FLAGS",
    "ISAS",
    "Isa",
    "NativeKernelUnavailable",
    "build",
    "c_compiler",
    "cpu_flags",
    "kernel_cache_dir",
    "load_kernel",
    "load_torch_extension",
    "select_isa",
]
