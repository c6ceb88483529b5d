"""MkDocs hooks: pages generated from the repository at build time.

Listed in ``mkdocs.yml`` (``hooks:``). Generated pages never exist in ``docs/``,
so they cannot go stale:

* ``reference/settings.md``: from ``spyre_inference.platform.settings``
  (:mod:`settings_reference`);
* ``examples.md``: ``examples/README.md`` followed by each script's source;
* ``benchmarks/index.md`` and one page per ``benchmarks/results/*.md``;
* ``changelogs/<distribution>.md``: each distribution's ``CHANGELOG.md``;
* ``packages/<distribution>.md``: each sub-package's ``README.md``.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

from mkdocs.structure.files import File, Files

sys.path.insert(0, str(Path(__file__).resolve().parent))

import settings_reference  # after the sys.path entry above

REPO = settings_reference.REPO


def _distributions() -> dict[str, Path]:
    """Distribution name -> its folder (the root one and every sub-package)."""
    found = {"spyre-inference": REPO}
    for folder in sorted((REPO / "packages").iterdir()):
        if (folder / "pyproject.toml").is_file():
            found[folder.name] = folder
    return found


def _first_heading(text: str, default: str) -> str:
    for line in text.splitlines():
        if line.startswith("# "):
            return line[2:].strip()
    return default


def _script_summary(path: Path) -> str:
    doc = ast.get_docstring(ast.parse(path.read_text())) or ""
    return doc.split("\n\n")[0].replace("\n", " ")


def examples_page() -> str:
    readme = (REPO / "examples" / "README.md").read_text()
    out = [readme.rstrip(), "", "## The scripts", ""]
    for script in sorted((REPO / "examples").glob("*.py")):
        out += [
            f"### `examples/{script.name}`",
            "",
            _script_summary(script),
            "",
            '```python title="examples/' + script.name + '"',
            script.read_text().rstrip(),
            "```",
            "",
        ]
    return "\n".join(out)


def benchmark_pages() -> dict[str, str]:
    results = sorted((REPO / "benchmarks" / "results").glob("*.md"))
    pages = {}
    index = [
        "# Benchmark results",
        "",
        "Written by the scripts in `benchmarks/` (each page is a committed "
        "`benchmarks/results/<name>.md`, shown here as it is). Each states the machine, "
        "the settings and the load it was measured under; the 2-core development machine "
        "is shared, so compare rows of one page rather than pages. Timed numbers never "
        "come from the test-suite.",
        "",
    ]
    for path in results:
        text = path.read_text()
        pages[f"benchmarks/{path.stem}.md"] = text
        index.append(f"- [{_first_heading(text, path.stem)}]({path.stem}.md)")
    if not results:
        index.append("No results committed yet.")
    pages["benchmarks/index.md"] = "\n".join(index) + "\n"
    return pages


def changelog_pages() -> dict[str, str]:
    pages = {}
    for dist, folder in _distributions().items():
        changelog = folder / "CHANGELOG.md"
        if changelog.is_file():
            text = changelog.read_text()
            if text.startswith("# Changelog"):
                text = f"# Changelog: {dist}" + text[len("# Changelog") :]
            pages[f"changelogs/{dist}.md"] = text
    return pages


def readme_pages() -> dict[str, str]:
    return {
        f"packages/{dist}.md": (folder / "README.md").read_text()
        for dist, folder in _distributions().items()
        if folder != REPO and (folder / "README.md").is_file()
    }


def generated_pages() -> dict[str, str]:
    """Every generated page: path under docs/ -> markdown."""
    return {
        "reference/settings.md": settings_reference.render(),
        "examples.md": examples_page(),
        **benchmark_pages(),
        **changelog_pages(),
        **readme_pages(),
    }


def benchmark_assets() -> dict[str, Path]:
    """Plots the result pages link to, served next to those pages."""
    results = REPO / "benchmarks" / "results"
    return {
        f"benchmarks/{path.name}": path
        for path in sorted(results.glob("*"))
        if path.suffix in (".svg", ".png")
    }


def on_files(files: Files, config) -> Files:
    for src_uri, content in generated_pages().items():
        existing = files.get_file_from_path(src_uri)
        if existing is not None:
            files.remove(existing)
        files.append(File.generated(config, src_uri, content=content))
    for src_uri, path in benchmark_assets().items():
        files.append(File.generated(config, src_uri, abs_src_path=str(path)))
    return files
