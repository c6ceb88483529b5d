"""Build and load the cpu target's small C kernels (host GEMM, decode attention).

The cpu target replaces a few PyTorch paths that are slow on CPUs without
16-bit matrix instructions with AVX2 kernels of the plugin's packages. They
need no torch headers: each is one C file built with the system C compiler in
about a second, cached per machine under ``cache_root()/kernels`` by a hash of
its source, flags and compiler, and loaded with ctypes. One place builds them
so every package finds the same cache and gives the same reasons when a host
cannot have them.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from collections.abc import Sequence
from pathlib import Path

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


def check_avx2_host() -> None:
    """Raise :class:`NativeKernelUnavailable` unless x86-64 with AVX2/FMA/F16C."""
    if platform.machine() not in ("x86_64", "AMD64"):
        raise NativeKernelUnavailable(
            f"the kernels are x86-64 only (this host: {platform.machine()})"
        )
    missing = [f for f in AVX2_CPU_FLAGS if f not in cpu_flags()]
    if missing:
        raise NativeKernelUnavailable(f"the CPU lacks {', '.join(missing)}")


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


def load_avx2_kernel(source: Path) -> ctypes.CDLL:
    """Check the host, build ``source`` with :data:`AVX2_CFLAGS` and load it."""
    check_avx2_host()
    return ctypes.CDLL(str(build(source)))


__all__ = [
    "AVX2_CFLAGS",
    "AVX2_CPU_FLAGS",
    "NativeKernelUnavailable",
    "build",
    "c_compiler",
    "check_avx2_host",
    "cpu_flags",
    "kernel_cache_dir",
    "load_avx2_kernel",
]
