"""Check built release artifacts against the sources they came from.

Run by ``nox -s release`` after it built an sdist and a wheel (from that sdist)
of every distribution into one folder; ``twine check --strict`` covers what
PyPI would reject (metadata syntax, README rendering), this covers what would
make a release wrong although PyPI accepts it:

* each distribution has exactly one sdist and one wheel, named with the
  version in its ``_version.py``;
* the wheel's metadata says the same name, version, Python and licence as
  ``pyproject.toml``, requires exactly the declared dependencies and extras,
  and its ``entry_points.txt`` holds exactly the declared entry points and
  scripts;
* every requirement on a sibling is a range with a lower and an upper bound
  that contains the sibling's current version (siblings release
  independently, so ``==`` would force lock-step releases and no upper bound
  would let a breaking sibling in);
* the wheel holds only its own ``spyre_inference/<package>/`` tree (no
  ``spyre_inference/__init__.py``: the namespace is shared, PEP 420), and the
  sdist holds the README, the changelog, ``pyproject.toml`` and the sources,
  and no other distribution's files;
* the changelog has a section for the version (``--final``: one not marked
  unreleased).

Usage: ``python tools/release_check.py DIST_DIR [--final]`` (needs ``packaging``).
"""

from __future__ import annotations

import argparse
import email.parser
import re
import sys
import tarfile
import tomllib
import zipfile
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

REPO = Path(__file__).resolve().parent.parent


def source_dists() -> dict[str, Path]:
    """Canonical distribution name -> source folder (root and packages/*)."""
    found = {}
    for folder in [REPO, *sorted((REPO / "packages").iterdir())]:
        if (folder / "pyproject.toml").is_file():
            name = tomllib.loads((folder / "pyproject.toml").read_text())["project"]["name"]
            found[canonicalize_name(name)] = folder
    return found


def source_version(folder: Path, project: dict) -> str:
    path = (
        folder
        / tomllib.loads((folder / "pyproject.toml").read_text())["tool"]["hatch"]["version"]["path"]
    )
    match = re.search(r"""__version__\s*=\s*["']([^"']+)["']""", path.read_text())
    if not match:
        raise ValueError(f"no __version__ in {path}")
    return match.group(1)


def _norm_req(text: str) -> str:
    req = Requirement(text)
    marker = f"; {req.marker}" if req.marker else ""
    extras = f"[{','.join(sorted(req.extras))}]" if req.extras else ""
    return f"{canonicalize_name(req.name)}{extras}{req.specifier}{marker}"


def expected_requires(project: dict) -> set[str]:
    reqs = {_norm_req(r) for r in project.get("dependencies", [])}
    for extra, items in project.get("optional-dependencies", {}).items():
        for item in items:
            req = Requirement(item)
            marker = f"({req.marker}) and extra == '{extra}'" if req.marker else None
            base = str(req).split(";")[0]
            text = f"{base}; {marker}" if marker else f'{base}; extra == "{extra}"'
            reqs.add(_norm_req(text))
    return reqs


def expected_entry_points(project: dict) -> dict[str, dict[str, str]]:
    groups = {g: dict(eps) for g, eps in project.get("entry-points", {}).items()}
    if project.get("scripts"):
        groups["console_scripts"] = dict(project["scripts"])
    return groups


def parse_entry_points(text: str) -> dict[str, dict[str, str]]:
    groups: dict[str, dict[str, str]] = {}
    current = None
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        if line.startswith("[") and line.endswith("]"):
            current = groups.setdefault(line[1:-1], {})
        elif current is not None:
            name, _, value = line.partition("=")
            current[name.strip()] = value.strip()
    return groups


def check_sibling_ranges(
    name: str, requires: list[str], versions: dict[str, str], errors: list[str]
) -> None:
    for text in requires:
        req = Requirement(text)
        sibling = canonicalize_name(req.name)
        if sibling not in versions:
            continue
        ops = {spec.operator for spec in req.specifier}
        lower = ops & {">=", ">", "~="}
        upper = ops & {"<", "<=", "~="}
        if "==" in ops or "===" in ops or not lower or not upper:
            errors.append(
                f"{name}: requirement {text!r} on sibling {sibling} must be a range with a "
                "lower and an upper bound (siblings release independently)"
            )
        if not req.specifier.contains(Version(versions[sibling]), prereleases=True):
            errors.append(
                f"{name}: requirement {text!r} excludes {sibling} {versions[sibling]} "
                "(this checkout's version): widen the range or release in order"
            )


def check_changelog(name: str, folder: Path, version: str, final: bool, errors: list[str]):
    changelog = folder / "CHANGELOG.md"
    if not changelog.is_file():
        errors.append(f"{name}: no CHANGELOG.md")
        return
    heading = re.search(
        rf"^##\s+{re.escape(version)}\b(.*)$", changelog.read_text(), flags=re.MULTILINE
    )
    if heading is None:
        errors.append(f"{name}: CHANGELOG.md has no '## {version}' section")
    elif final and "unreleased" in heading.group(1).lower():
        errors.append(f"{name}: CHANGELOG.md still marks {version} as unreleased")


def check_wheel(
    name: str, wheel: Path, project: dict, version: str, errors: list[str]
) -> list[str]:
    """Metadata and contents of one wheel; returns its Requires-Dist lines."""
    with zipfile.ZipFile(wheel) as zf:
        files = zf.namelist()
        dist_info = f"{name.replace('-', '_')}-{version}.dist-info"
        meta = email.parser.Parser().parsestr(zf.read(f"{dist_info}/METADATA").decode())
        eps_text = (
            zf.read(f"{dist_info}/entry_points.txt").decode()
            if f"{dist_info}/entry_points.txt" in files
            else ""
        )
    requires = meta.get_all("Requires-Dist") or []
    checks = {
        "Name": (canonicalize_name(meta["Name"] or ""), name),
        "Version": (meta["Version"], version),
        "Requires-Python": (meta["Requires-Python"], project.get("requires-python")),
        "License-Expression": (meta["License-Expression"], project.get("license")),
        "Description-Content-Type": (meta["Description-Content-Type"], "text/markdown"),
    }
    for field, (got, want) in checks.items():
        if got != want:
            errors.append(f"{wheel.name}: {field} is {got!r}, pyproject says {want!r}")
    if not (meta.get_payload() or "").strip():
        errors.append(f"{wheel.name}: empty long description (README)")
    got_reqs = {_norm_req(r) for r in requires}
    want_reqs = expected_requires(project)
    if got_reqs != want_reqs:
        errors.append(
            f"{wheel.name}: Requires-Dist differs from pyproject: "
            f"extra {sorted(got_reqs - want_reqs)}, missing {sorted(want_reqs - got_reqs)}"
        )
    got_eps = parse_entry_points(eps_text)
    if got_eps != expected_entry_points(project):
        errors.append(
            f"{wheel.name}: entry points {got_eps} != pyproject {expected_entry_points(project)}"
        )
    code = [f for f in files if not f.startswith(dist_info + "/")]
    if "spyre_inference/__init__.py" in code:
        errors.append(f"{wheel.name}: ships spyre_inference/__init__.py (breaks the namespace)")
    packages = {tuple(f.split("/")[:2]) for f in code}
    if len(packages) != 1 or next(iter(packages))[0] != "spyre_inference":
        errors.append(f"{wheel.name}: expected one spyre_inference/<package>/ tree, got {packages}")
    elif not any(f.endswith("/_version.py") for f in code):
        errors.append(f"{wheel.name}: no _version.py")
    return requires


def check_sdist(name: str, sdist: Path, folder: Path, version: str, errors: list[str]) -> None:
    prefix = f"{name.replace('-', '_')}-{version}"
    with tarfile.open(sdist) as tf:
        members = {m.name.removeprefix(prefix + "/") for m in tf.getmembers()}
    for required in ("pyproject.toml", "README.md", "CHANGELOG.md", "PKG-INFO"):
        if required not in members:
            errors.append(f"{sdist.name}: missing {required}")
    sources = {
        str(p.relative_to(folder))
        for p in (folder / "src").rglob("*.py")
        if "__pycache__" not in p.parts
    }
    if folder == REPO:  # the root's src/ holds only its own package
        sources = {s for s in sources if s.startswith("src/spyre_inference/default_model/")}
    missing = sorted(sources - members)
    if missing:
        errors.append(f"{sdist.name}: sources missing from the sdist: {missing[:5]}")
    foreign = sorted(m for m in members if m.startswith("packages/"))
    if foreign:
        errors.append(f"{sdist.name}: carries other distributions' files: {foreign[:3]} ...")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("dist_dir", type=Path)
    parser.add_argument("--final", action="store_true", help="changelogs must not say unreleased")
    args = parser.parse_args(argv)
    dists = source_dists()
    projects, versions = {}, {}
    for name, folder in dists.items():
        projects[name] = tomllib.loads((folder / "pyproject.toml").read_text())["project"]
        versions[name] = source_version(folder, projects[name])
    errors: list[str] = []
    for name, folder in dists.items():
        stem = f"{name.replace('-', '_')}-{versions[name]}"
        wheels = sorted(args.dist_dir.glob(f"{name.replace('-', '_')}-*.whl"))
        sdists = sorted(args.dist_dir.glob(f"{name.replace('-', '_')}-*.tar.gz"))
        wheel = args.dist_dir / f"{stem}-py3-none-any.whl"
        sdist = args.dist_dir / f"{stem}.tar.gz"
        if wheels != [wheel] or sdists != [sdist]:
            errors.append(
                f"{name}: expected {wheel.name} and {sdist.name}, found "
                f"{[p.name for p in wheels + sdists]}"
            )
            continue
        requires = check_wheel(name, wheel, projects[name], versions[name], errors)
        check_sibling_ranges(name, requires, versions, errors)
        check_sdist(name, sdist, folder, versions[name], errors)
        check_changelog(name, folder, versions[name], args.final, errors)
        print(f"{name} {versions[name]}: {wheel.name}, {sdist.name}")
    if errors:
        print("release check FAILED:\n  " + "\n  ".join(errors), file=sys.stderr)
        return 1
    print(f"release check passed: {len(dists)} distributions")
    return 0


if __name__ == "__main__":
    sys.exit(main())
