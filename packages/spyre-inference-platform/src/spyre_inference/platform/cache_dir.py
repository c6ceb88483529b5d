"""The plugin's per-user cache directory, shared by everything it caches.

Inductor's on-disk caches, the cpu target's host GEMM kernel builds and the
embedded default model all live under one root, so a user clears or moves
them in one place. Per user and stable across reboots, as the XDG base
directory convention has it (unlike torch's defaults under the temp directory).
"""

from __future__ import annotations

import os
from pathlib import Path


def cache_root() -> Path:
    """``$XDG_CACHE_HOME/spyre-inference`` (``~/.cache/spyre-inference`` when unset)."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base).expanduser() / "spyre-inference"
