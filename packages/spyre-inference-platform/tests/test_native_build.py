"""Torch extensions are built once per source, torch installation and flags, then reused.

``load_torch_extension`` compiles with ninja, which rebuilds whenever the compile
command or the source's path or mtime changes. Builds are therefore keyed on the
torch installation (its include directories are in the command) and compiled from
a copy of the source in the build directory, written once. Checked on the emulated
card's extension, which the platform builds anyway (no extra compile here).
"""

from __future__ import annotations

import pytest
from torch.utils.cpp_extension import include_paths

from spyre_inference.platform import emulated_card
from spyre_inference.platform.native_build import (
    NativeKernelUnavailable,
    kernel_cache_dir,
    load_torch_extension,
)


def test_a_second_load_reuses_the_build_from_its_staged_source() -> None:
    try:
        load_torch_extension(emulated_card.SOURCE)
    except NativeKernelUnavailable as exc:
        pytest.skip(str(exc))
    source, text = emulated_card.SOURCE, emulated_card.SOURCE.read_bytes()
    # Builds of this source text (older texts and older layouts may sit beside them).
    builds = [
        d
        for d in kernel_cache_dir().glob(f"{source.stem}-*")
        if (d / source.name).exists() and (d / source.name).read_bytes() == text
    ]
    # This torch installation's: the one build whose compile command names its headers.
    torch_include = include_paths()[0]
    (build,) = [d for d in builds if torch_include in (d / "build.ninja").read_text()]
    staged = build / source.name
    assert str(staged) in (build / "build.ninja").read_text()
    library = next(build.glob("*.so"))
    before = (library.stat().st_mtime_ns, staged.stat().st_mtime_ns)
    load_torch_extension(emulated_card.SOURCE)
    assert (library.stat().st_mtime_ns, staged.stat().st_mtime_ns) == before
