"""Each package declares the settings it reads (issue 23, item 6).

The core collects the sub-packages' settings through the entry-point group
``spyre_inference.settings``. A setting declared by a sub-package must be read by
that package alone; one that several packages read belongs to the core.
"""

from __future__ import annotations

import importlib.metadata as md
import re
import subprocess
import sys
from pathlib import Path

from spyre_inference.platform import settings

REPO = Path(__file__).resolve().parents[1]
CORE = "spyre-inference-platform"


def _source_root(dist: str) -> Path:
    return REPO / "src" if dist == "spyre-inference" else REPO / "packages" / dist / "src"


def _readers(name: str) -> set[str]:
    """Distributions whose sources read ``name`` through the settings module."""
    pattern = re.compile(rf"settings\.(?:get|is_set)\(\s*[\"']{name}[\"']")
    dists = ["spyre-inference", *(p.name for p in (REPO / "packages").iterdir())]
    return {
        dist
        for dist in dists
        if any(pattern.search(f.read_text()) for f in _source_root(dist).rglob("*.py"))
    }


def test_each_setting_is_declared_by_the_package_that_reads_it() -> None:
    owner = {s.name: CORE for s in settings.SETTINGS}
    for ep in md.entry_points(group=settings.ENTRY_POINT_GROUP):
        owner.update((s.name, ep.dist.name) for s in ep.load())
    # All six distributions are installed here: every declared setting is known.
    assert sorted(owner) == sorted(s.name for s in settings.all_settings())
    assert {"spyre-inference-attention", "spyre-inference-ops", "spyre-inference"} <= set(
        owner.values()
    )
    misplaced = {}
    for name, dist in owner.items():
        readers = _readers(name)
        assert readers, f"{name} is declared but no package reads it"
        if dist != CORE and readers != {dist}:
            misplaced[name] = (dist, sorted(readers))
    assert not misplaced, f"declared by one package, read by others: {misplaced}"


def test_the_settings_are_collected_inside_vllms_own_import() -> None:
    """vLLM resolves the platform while it imports ``vllm.config``; the platform's first
    setting read collects every package's settings then, so their modules (and their
    packages' ``__init__``) must not import vLLM's layers. In a fresh interpreter."""
    code = (
        "import vllm.v1.engine\n"
        "from spyre_inference.platform import settings\n"
        "print(len(settings.all_settings()))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert int(done.stdout.split()[-1]) == len(settings.all_settings())
