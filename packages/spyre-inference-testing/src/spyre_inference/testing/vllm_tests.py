"""Run test files of vLLM's own test-suite (from its sdist) against the plugin.

vLLM's tests live in its source distribution, which the environment tooling
caches beside the vLLM wheel (``$SPYRE_INFERENCE_CACHE/sdist``). A file runs in
its own pytest process, from a folder holding just the tests it needs, without
vLLM's top-level conftest (``--noconftest``: that one imports CUDA-only
helpers). Hub model names can be served from local models: :func:`hub_cache`
lays out a Hugging Face cache whose entries are the given folders, so with
``HF_HUB_OFFLINE=1`` a test's ``LLM("org/name")`` loads the local model.
"""

from __future__ import annotations

import dataclasses
import os
import re
import subprocess
import sys
import tarfile
from collections.abc import Mapping, Sequence
from pathlib import Path


def sdist_path() -> Path:
    """Where the environment tooling caches the installed vLLM's sdist."""
    import vllm

    cache = Path(os.environ.get("SPYRE_INFERENCE_CACHE") or "~/.cache/spyre-inference")
    version = vllm.__version__.split("+")[0]
    return cache.expanduser() / "sdist" / f"vllm-{version}.tar.gz"


def extract_tests(test_file: str, dest: Path) -> Path:
    """Extract ``test_file`` (``tests/...``), its folder, the package markers and
    ``tests/utils.py``; returns the extracted root."""
    sdist = sdist_path()
    if not sdist.is_file():
        raise FileNotFoundError(
            f"the vLLM sdist is not at {sdist}; the environment tooling (tools/spyre_env.py) "
            "caches it beside the vLLM wheel. Set SPYRE_INFERENCE_CACHE if it lives elsewhere."
        )
    prefix = sdist.name.removesuffix(".tar.gz")
    folder = Path(test_file).parent
    wanted = [f"{prefix}/{folder.as_posix()}/"]
    wanted += [f"{prefix}/{p.as_posix()}/__init__.py" for p in (folder, *folder.parents)]
    # The suite's shared helpers (``from tests.utils import ...``).
    wanted.append(f"{prefix}/tests/utils.py")
    with tarfile.open(sdist) as tar:
        members = [m for m in tar.getmembers() if m.name.startswith(tuple(wanted))]
        tar.extractall(dest, members=members, filter="data")
    return dest / prefix


def hub_cache(root: Path, models: Mapping[str, Path]) -> Path:
    """A Hugging Face cache under ``root`` where each hub name resolves to a local folder."""
    commit = "0" * 40
    for name, folder in models.items():
        repo = root / "hub" / ("models--" + name.replace("/", "--"))
        snapshot = repo / "snapshots" / commit
        snapshot.mkdir(parents=True, exist_ok=True)
        for item in Path(folder).iterdir():
            link = snapshot / item.name
            if not link.exists():
                link.symlink_to(item.resolve())
        (repo / "refs").mkdir(exist_ok=True)
        (repo / "refs" / "main").write_text(commit)
    return root


@dataclasses.dataclass(frozen=True)
class FileResult:
    returncode: int
    passed: int
    failed: int
    skipped: int
    tail: str


def run_test_file(
    test_file: str,
    workdir: Path,
    *,
    deselect: str | None = None,
    plugins: Sequence[str] = (),
    plugin_dirs: Sequence[Path] = (),
    hub_models: Mapping[str, Path] | None = None,
    timeout: float = 1100,
) -> FileResult:
    """Run one vLLM test file in a fresh pytest process; its counts and output tail."""
    root = extract_tests(test_file, workdir / "src")
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        [*map(str, plugin_dirs), str(root), env.get("PYTHONPATH", "")]
    )
    if hub_models:
        env["HF_HOME"] = str(hub_cache(workdir / "hf", hub_models))
        env.pop("HF_HUB_CACHE", None)
        env["HF_HUB_OFFLINE"] = "1"
        env["TRANSFORMERS_OFFLINE"] = "1"
    cmd = [
        sys.executable,
        "-m",
        "pytest",
        test_file,
        "-q",
        "--noconftest",
        "-p",
        "no:cacheprovider",
    ]
    if deselect:
        cmd += ["-k", f"not ({deselect})"]
    for plugin in plugins:
        cmd += ["-p", plugin]
    done = subprocess.run(
        cmd, cwd=root, env=env, capture_output=True, text=True, timeout=timeout, check=False
    )

    def count(word: str) -> int:
        found = re.search(rf"(\d+) {word}", done.stdout)
        return int(found.group(1)) if found else 0

    return FileResult(
        done.returncode,
        count("passed"),
        count("failed") + count("error"),
        count("skipped") + count("deselected"),
        "\n".join(done.stdout.splitlines()[-30:]),
    )


__all__ = ["FileResult", "extract_tests", "hub_cache", "run_test_file", "sdist_path"]
