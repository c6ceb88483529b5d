"""Build ``docs/support-matrix.md`` from the junit XML of a test run.

The page is never edited by hand. Each feature of the catalogue
(``tools/support_matrix.toml``: the engine features of issue 8 and the pieces
of the spec, tested or not) is mapped to tests in two ways: a test can name
its features with ``@pytest.mark.feature("id", ...)`` (``tests/conftest.py``
records them as junit properties), and a feature can list node-id patterns
(``fnmatch``) for tests that carry no marker. A
feature's status is what its tests did in the run:

* ``passed``: at least one of its tests passed and none failed;
* ``FAILED``: one of its tests failed or errored;
* ``skipped``: all of its tests were skipped (for example: needs a card);
* ``not run``: it has tests, but the junit files given contain none of them
  (their nox session was not part of the run);
* ``not tested``: no test shows it.

Usage (``scripts/test.sh`` leaves one junit file per nox session in
``build/junit/``)::

    scripts/test.sh                        # or: scripts/test.sh -s e2e
    python tools/support_matrix.py         # build/junit/*.xml -> docs/support-matrix.md
    python tools/support_matrix.py run1.xml more/ -o /tmp/matrix.md

A ``feature`` marker naming an id that is not in the catalogue is an error, so
the page cannot silently lose a test.
"""

from __future__ import annotations

import argparse
import dataclasses
import fnmatch
import sys
import tomllib
import xml.etree.ElementTree as ET
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any, TypeVar

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_INPUT = ROOT / "build" / "junit"
DEFAULT_OUTPUT = ROOT / "docs" / "support-matrix.md"

CATALOGUE = Path(__file__).with_name("support_matrix.toml")

Row = TypeVar("Row")


@dataclasses.dataclass(frozen=True)
class Feature:
    id: str
    area: str
    title: str
    #: where the requirement comes from: "issue 8", "spec", ...
    source: str
    #: node-id patterns (fnmatch) of tests without a feature marker that show it
    tests: tuple[str, ...] = ()
    #: "works", or "refused": the plugin rejects it with a clear error
    expect: str = "works"
    note: str = ""


def read_catalogue(
    path: Path, table: str, row: type[Row], key: str, key_name: str
) -> tuple[Row, ...]:
    """The ``[[table]]`` entries of a TOML catalogue as ``row`` objects, in file order.

    Shared with ``models_table.py``: each entry's ``tests`` (node-id patterns,
    optional) becomes a tuple, and the ``key`` attribute must be unique
    (``key_name`` names it in the error).
    """
    with path.open("rb") as f:
        entries: list[dict[str, Any]] = tomllib.load(f)[table]
    rows = tuple(row(**{**e, "tests": tuple(e.get("tests", ()))}) for e in entries)
    keys = [getattr(r, key) for r in rows]
    duplicates = sorted({k for k in keys if keys.count(k) > 1})
    if duplicates:
        raise ValueError(f"{path}: duplicate {key_name} {duplicates}")
    return rows


def load_catalogue(path: Path = CATALOGUE) -> tuple[Feature, ...]:
    """The features of ``support_matrix.toml``, in file order."""
    features = read_catalogue(path, "feature", Feature, "id", "feature ids")
    bad = sorted({f.expect for f in features} - {"works", "refused"})
    if bad:
        raise ValueError(f"{path}: expect must be 'works' or 'refused', not {bad}")
    return features


FEATURES = load_catalogue()
BY_ID = {f.id: f for f in FEATURES}


@dataclasses.dataclass(frozen=True)
class Result:
    session: str
    nodeid: str
    outcome: str  # passed | failed | error | skipped
    seconds: float
    features: tuple[str, ...]
    message: str = ""
    #: other junit properties (figures a test recorded with ``record_property``)
    figures: tuple[tuple[str, str], ...] = ()


def _nodeid(classname: str, name: str, root: Path) -> str:
    """pytest's node id from a junit (classname, name): the longest classname
    prefix that is a file of the repository is the module, the rest classes."""
    parts = classname.split(".")
    for i in range(len(parts), 0, -1):
        path = "/".join(parts[:i]) + ".py"
        if (root / path).is_file():
            return "::".join([path, *parts[i:], name])
    return "::".join([classname.replace(".", "/") + ".py", name])


def read_junit(path: Path, root: Path = ROOT) -> list[Result]:
    """Test results of one junit XML file; the session is the file's stem."""
    tree = ET.parse(path).getroot()
    results = []
    for case in tree.iter("testcase"):
        outcome, message = "passed", ""
        for tag in ("failure", "error", "skipped"):
            child = case.find(tag)
            if child is not None:
                outcome = {"failure": "failed"}.get(tag, tag)
                message = child.get("message", "")
                break
        properties = [(p.get("name", ""), p.get("value", "")) for p in case.iter("property")]
        features = tuple(value for name, value in properties if name == "feature")
        figures = tuple((name, value) for name, value in properties if name != "feature")
        results.append(
            Result(
                session=path.stem,
                nodeid=_nodeid(case.get("classname", ""), case.get("name", ""), root),
                outcome=outcome,
                seconds=float(case.get("time", 0) or 0),
                features=features,
                message=message,
                figures=figures,
            )
        )
    return results


def junit_files(inputs: Sequence[Path]) -> list[Path]:
    files: list[Path] = []
    for item in inputs:
        files.extend(sorted(item.glob("*.xml")) if item.is_dir() else [item])
    return files


def unknown_feature_ids(results: Iterable[Result]) -> dict[str, list[str]]:
    unknown: dict[str, list[str]] = {}
    for r in results:
        for fid in r.features:
            if fid not in BY_ID:
                unknown.setdefault(fid, []).append(r.nodeid)
    return unknown


def tests_of(feature: Feature, results: Iterable[Result]) -> list[Result]:
    return [
        r
        for r in results
        if feature.id in r.features or any(fnmatch.fnmatchcase(r.nodeid, p) for p in feature.tests)
    ]


def status(feature: Feature, mapped: Sequence[Result]) -> str:
    if not mapped:
        return "not run" if feature.tests else "not tested"
    outcomes = {r.outcome for r in mapped}
    if outcomes & {"failed", "error"}:
        return "FAILED"
    if outcomes == {"skipped"}:
        return "skipped"
    return "refused clearly" if feature.expect == "refused" else "passed"


def evidence(mapped: Sequence[Result], limit: int = 3) -> str:
    if not mapped:
        return ""
    counts: dict[str, int] = {}
    for r in mapped:
        counts[r.outcome] = counts.get(r.outcome, 0) + 1
    summary = ", ".join(f"{n} {o}" for o, n in sorted(counts.items()))
    # Failures first, then by node id; parametrised ids collapse onto their test.
    ordered = sorted(mapped, key=lambda r: (r.outcome == "passed", r.nodeid))
    shown: list[str] = []
    for r in ordered:
        test = r.nodeid.split("[", 1)[0]
        if test not in shown:
            shown.append(test)
    listed = "<br>".join(f"`{t}`" for t in shown[:limit])
    more = f"<br>and {len(shown) - limit} more" if len(shown) > limit else ""
    skipped = {r.message for r in mapped if r.outcome == "skipped" and r.message}
    why = f"<br>skipped: {'; '.join(sorted(skipped))}" if skipped else ""
    figures = dict.fromkeys(
        f"{name}={_short(value)}"
        for r in ordered
        if r.nodeid.split("[", 1)[0] in shown[:limit]
        for name, value in r.figures
    )
    measured = f"<br>measured: {'; '.join(figures)}" if figures else ""
    return f"{summary}: {listed}{more}{why}{measured}".replace("|", "\\|")


def _short(value: str, width: int = 48) -> str:
    value = " ".join(value.split())
    return value if len(value) <= width else value[: width - 3] + "..."


def run_line(results: Sequence[Result], files: Sequence[Path]) -> str:
    """Which sessions the page reflects: name, date of the run, test counts."""
    parts = []
    for path in files:
        stamps = [s.get("timestamp", "") for s in ET.parse(path).getroot().iter("testsuite")]
        day = min((t for t in stamps if t), default="")[:10]
        mine = [r for r in results if r.session == path.stem]
        counts: dict[str, int] = {}
        for r in mine:
            counts[r.outcome] = counts.get(r.outcome, 0) + 1
        summary = ", ".join(f"{n} {o}" for o, n in sorted(counts.items())) or "no tests"
        parts.append(f"`{path.stem}` ({day or 'undated'}: {summary})")
    return "Run: " + "; ".join(parts) + ". Sessions not listed did not run."


def render(results: Sequence[Result], files: Sequence[Path]) -> str:
    lines = [
        "# Support matrix",
        "",
        "<!-- Generated by tools/support_matrix.py from junit XML; do not edit by hand. -->",
        "",
        "What the plugin supports on the **cpu target**, as shown by a test run. Each",
        "feature of issue 8 (vLLM feature parity) and of the plugin spec is listed,",
        "tested or not; its status is what its tests did in the run below. Regenerate",
        "after a run with:",
        "",
        "```bash",
        "scripts/test.sh                  # writes build/junit/<session>.xml",
        "python tools/support_matrix.py   # writes docs/support-matrix.md",
        "```",
        "",
        run_line(results, files),
        "",
        "Status: **passed** (its tests passed), **refused clearly** (the plugin rejects it",
        "with a clear error, and a test shows that), **FAILED**, **skipped** (all its tests",
        "were skipped, e.g. they need a Spyre card), **not run** (its tests were not in",
        "this run), **not tested** (no test shows it).",
        "",
    ]
    for area in dict.fromkeys(f.area for f in FEATURES):
        features = [f for f in FEATURES if f.area == area]
        lines += [f"## {area}", "", "| Feature | From | Status | Tests |", "|---|---|---|---|"]
        for feature in features:
            mapped = tests_of(feature, results)
            title = feature.title + (f" ({feature.note})" if feature.note else "")
            lines.append(
                f"| {title} | {feature.source} | {status(feature, mapped)} | {evidence(mapped)} |"
            )
        lines.append("")
    untested = [f.title for f in FEATURES if status(f, tests_of(f, results)) == "not tested"]
    lines += [
        "## Summary",
        "",
        f"{len(FEATURES)} features; not tested: {len(untested)}"
        + (f" ({'; '.join(untested)})." if untested else "."),
        "",
    ]
    return "\n".join(lines)


def parse_run(
    argv: Sequence[str] | None, description: str, default_output: Path
) -> tuple[Path, list[Path], list[Result]]:
    """The command line both generators share: ``[junit files or folders] [-o page]``;
    returns the output page, the junit files and their results."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("inputs", nargs="*", type=Path, default=[DEFAULT_INPUT])
    parser.add_argument("-o", "--output", type=Path, default=default_output)
    args = parser.parse_args(argv)
    files = junit_files(args.inputs)
    if not files:
        parser.error(f"no junit XML in {', '.join(map(str, args.inputs))}: run the tests first")
    return args.output, files, [r for path in files for r in read_junit(path)]


def write_page(output: Path, page: str, files: Sequence[Path], results: Sequence[Result]) -> None:
    """Write a generated page (both generators end so) and say what it came from."""
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(page)
    print(f"wrote {output} from {len(files)} junit file(s), {len(results)} test results")


def main(argv: Sequence[str] | None = None) -> int:
    output, files, results = parse_run(argv, __doc__.split("\n\n")[0], DEFAULT_OUTPUT)
    unknown = unknown_feature_ids(results)
    if unknown:
        for fid, tests in sorted(unknown.items()):
            print(f"unknown feature id {fid!r} (add it to FEATURES): {tests}", file=sys.stderr)
        return 1
    write_page(output, render(results, files), files, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
