"""Run test files of vLLM's own test-suite (from its sdist) against the plugin.

vLLM's tests live in its source distribution, which the environment tooling
caches beside the vLLM wheel (``$SPYRE_INFERENCE_CACHE/sdist``). Files run in
a fresh pytest process, from a folder holding just the tests they need, without
vLLM's top-level conftest (``--noconftest``: that one imports CUDA-only
helpers). Hub model names can be served from local models: :func:`hub_cache`
lays out a Hugging Face cache whose entries are the given folders, so with
``HF_HUB_OFFLINE=1`` a test's ``LLM("org/name")`` loads the local model.
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import tarfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from xml.etree import ElementTree


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


def run_test_files(
    test_files: Mapping[str, str | None],
    workdir: Path,
    *,
    plugins: Sequence[str] = (),
    plugin_dirs: Sequence[Path] = (),
    hub_models: Mapping[str, Path] | None = None,
    timeout: float = 1100,
) -> dict[str, FileResult]:
    """Run vLLM test files in one fresh pytest process; each file's counts.

    ``test_files`` maps a path (``tests/...``) to a ``-k`` expression of the
    tests to deselect in that file, or None. One process for all of them
    because each process pays vLLM's import (~13 s on a 2-core AVX2 host)
    before the first test runs; the per-file results come from pytest's JUnit
    report, so a failure still names its file.
    """
    root = workdir / "src"
    for test_file in test_files:
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
    junit = workdir / "junit.xml"
    cmd = [sys.executable, "-m", "pytest", *test_files, "-q", "--noconftest"]
    cmd += ["-p", "no:cacheprovider", f"--junitxml={junit}"]
    # A file's deselection applies inside that file only: -k matches a test's
    # parent names too, so each clause is scoped by its module's name.
    scoped = [f"({Path(f).stem} and ({expr}))" for f, expr in test_files.items() if expr]
    if scoped:
        cmd += ["-k", f"not ({' or '.join(scoped)})"]
    for plugin in plugins:
        cmd += ["-p", plugin]
    done = subprocess.run(
        cmd, cwd=root, env=env, capture_output=True, text=True, timeout=timeout, check=False
    )
    tail = "\n".join(done.stdout.splitlines()[-30:])
    counts = _junit_counts(junit) if junit.is_file() else {}
    results = {}
    for test_file in test_files:
        module = test_file.removesuffix(".py").replace("/", ".")
        passed, failed, skipped = counts.get(module, (0, 0, 0))
        # A crash, a collection error or an interrupt fails every file of the run.
        broken = done.returncode not in (0, 1)
        code = 1 if failed or broken or (done.returncode and not counts) else 0
        results[test_file] = FileResult(code, passed, failed, skipped, tail)
    return results


def _junit_counts(report: Path) -> dict[str, tuple[int, int, int]]:
    """Passed, failed (errors included) and skipped test counts per module of a JUnit report."""
    counts: dict[str, list[int]] = {}
    for case in ElementTree.parse(report).iter("testcase"):
        classname = case.get("classname", "")
        # ``classname`` is the module's dotted path, then the class for methods.
        module = (
            classname
            if classname.rsplit(".", 1)[-1].startswith("test_")
            else (classname.rsplit(".", 1)[0])
        )
        row = counts.setdefault(module, [0, 0, 0])
        tags = {child.tag for child in case}
        if tags & {"failure", "error"}:
            row[1] += 1
        elif "skipped" in tags:
            row[2] += 1
        else:
            row[0] += 1
    return {module: (p, f, s) for module, (p, f, s) in counts.items()}


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
    results = run_test_files(
        {test_file: deselect},
        workdir,
        plugins=plugins,
        plugin_dirs=plugin_dirs,
        hub_models=hub_models,
        timeout=timeout,
    )
    return results[test_file]


__all__ = [
    "FileResult",
    "extract_tests",
    "hub_cache",
    "run_test_file",
    "run_test_files",
    "sdist_path",
]
