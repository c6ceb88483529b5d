"""Generate the settings reference page from every package's declared settings.

The core's ``spyre_inference.platform.settings`` and each package's module named
in its ``pyproject.toml`` under the entry-point group ``spyre_inference.settings``
are loaded from their files, not imported as packages: the packages import torch
and vLLM, which the docs venv does not have (and does not need: the settings
modules use only the standard library and the core's ``settings``). Every
``Setting`` becomes one section (default, accepted values, meaning, and
which modules read it, found by searching the packages' sources). Variables the
plugin reads that are not its own settings (vLLM's, torch's, the build
scripts') are listed from :data:`OTHER_VARIABLES`; ``tools/docs/test_docs.py``
fails when code reads an environment variable that this page does not list.
"""

from __future__ import annotations

import importlib.util
import re
import sys
import tomllib
from pathlib import Path
from types import ModuleType, SimpleNamespace

REPO = Path(__file__).resolve().parents[2]
SETTINGS_FILE = REPO / "packages/spyre-inference-platform/src/spyre_inference/platform/settings.py"
#: Where settings are read: every distribution's sources.
SOURCE_ROOTS = (*sorted((REPO / "packages").glob("*/src")), REPO / "src")
ENTRY_POINT_GROUP = "spyre_inference.settings"


def package_settings_files() -> dict[str, Path]:
    """Distribution -> the file of the settings module it publishes (entry-point group)."""
    found = {}
    for folder in [REPO, *sorted((REPO / "packages").iterdir())]:
        if not (folder / "pyproject.toml").is_file():
            continue
        project = tomllib.loads((folder / "pyproject.toml").read_text())["project"]
        for target in project.get("entry-points", {}).get(ENTRY_POINT_GROUP, {}).values():
            module = target.split(":")[0]
            found[project["name"]] = folder / "src" / (module.replace(".", "/") + ".py")
    return found


def settings_files() -> list[Path]:
    """The core's settings file, then every package's."""
    return [SETTINGS_FILE, *package_settings_files().values()]


#: Variables the plugin reads or sets that belong to vLLM, torch or the OS.
#: name -> (who reads it, what it does here)
OTHER_VARIABLES: dict[str, tuple[str, str]] = {
    "VLLM_PLUGINS": (
        "vLLM; platform, discovery",
        "Comma-separated plugin names vLLM loads (unset: all). `VLLM_PLUGINS=spyre` loads "
        "only the platform (no ops/models swaps); the platform refuses a value that "
        "leaves out a sub-package the configuration needs.",
    ),
    "VLLM_WORKER_MULTIPROC_METHOD": (
        "vLLM; platform",
        "The platform defaults it to `spawn` (set only when unset).",
    ),
    "VLLM_DISABLE_COMPILE_CACHE": (
        "vLLM; block_compile",
        "`1` turns Inductor's on-disk caches off (they are the only compile caches here).",
    ),
    "VLLM_OMP_NUM_THREADS_SET_BY_VLLM": (
        "vLLM; worker",
        "Set by vLLM's launcher when it chose `OMP_NUM_THREADS` itself; the worker then "
        "restores torch's threads on the cpu target.",
    ),
    "VLLM_CONFIGURE_LOGGING": (
        "vLLM; spyre-inference-env",
        "`spyre-inference-env` sets it to `0` in its own process so vLLM's INFO lines do "
        "not mix with the report on stdout.",
    ),
    "OMP_NUM_THREADS": (
        "worker",
        "Compute threads per worker on the cpu target; when the user sets it, it wins "
        "over the worker's choice.",
    ),
    "TORCHINDUCTOR_CACHE_DIR": (
        "torch; block_compile",
        "Where Inductor caches compiled graphs. Unset (or torch's `/tmp` default): "
        "`$XDG_CACHE_HOME/spyre-inference/inductor`.",
    ),
    "XDG_CACHE_HOME": (
        "block_compile, default model, host GEMM kernel",
        "Base of the plugin's caches (`~/.cache` when unset).",
    ),
    "CC": (
        "ops host_gemm",
        "C compiler that builds the cpu target's host GEMM kernel once per machine "
        "(default: the first of `cc`, `gcc`, `clang` on PATH).",
    ),
    "RANK": ("worker (set)", "Exported per worker before the process groups exist."),
    "LOCAL_RANK": ("worker (set)", "As `RANK`: libspyre_comms reads them when it loads."),
    "WORLD_SIZE": ("worker (set)", "As `RANK`."),
    "LOCAL_WORLD_SIZE": ("worker (set, unless already set)", "As `RANK`."),
}

#: Variables of the build and test tooling (scripts/, tools/, noxfile.py).
TOOL_VARIABLES: dict[str, str] = {
    "SPYRE_INFERENCE_CACHE": "Cache root of the scripts and nox (vLLM wheel, venvs, bootstrap); "
    "default `~/.cache/spyre-inference`.",
    "SPYRE_INFERENCE_FIND_LINKS": "`os.pathsep`-separated folders holding the torch CPU wheel "
    "(default `/opt/wheels`).",
    "SPYRE_INFERENCE_PYTHON": "Interpreter new venvs are made from (default: `python3.11`, "
    "`python3`, `python`).",
    "SPYRE_SERVE_HOST": "`scripts/serve.sh`: address to bind (default `127.0.0.1`).",
    "SPYRE_SERVE_PORT": "`scripts/serve.sh`: port (default `8000`).",
    "SPYRE_SERVE_VENV": "`scripts/serve.sh`: venv to install into (default `<repo>/.venv`).",
    "SPYRE_INFERENCE_VLLM_SDIST": "Set by nox for the tests: vLLM's sdist, which carries "
    "vLLM's own test-suite.",
    "VLLM_ENABLE_V1_MULTIPROCESSING": "vLLM's: `tools/fuzz_engine.py` sets it to `0` to run "
    "the engine core in its own process.",
}


def _load_file(name: str, path: Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses resolve annotations through it
    spec.loader.exec_module(module)
    return module


def load_settings() -> SimpleNamespace:
    """Every declared setting (``.SETTINGS``) and its distribution (``.owner``)."""
    core_name = "spyre_inference.platform.settings"
    saved = sys.modules.get(core_name)
    try:
        # The packages' modules import the core's by name: it is this file-loaded one.
        core = _load_file(core_name, SETTINGS_FILE)
        found = [(s, "spyre-inference-platform") for s in core.SETTINGS]
        for dist, path in package_settings_files().items():
            module = _load_file(f"_spyre_settings_of_{dist.replace('-', '_')}", path)
            found += [(s, dist) for s in module.SETTINGS]
    finally:
        sys.modules.pop(core_name, None)
        if saved is not None:
            sys.modules[core_name] = saved
    return SimpleNamespace(SETTINGS=tuple(s for s, _ in found), owner={s.name: d for s, d in found})


def readers(name: str) -> list[str]:
    """Modules (dotted) that mention ``name``, other than settings.py itself."""
    found = []
    for root in SOURCE_ROOTS:
        for path in sorted(root.rglob("*.py")):
            if path in settings_files() or "testing" in path.relative_to(root).parts:
                continue
            if re.search(rf"\b{name}\b", path.read_text()):
                found.append(".".join(path.relative_to(root).with_suffix("").parts))
    return found


def _escape_cell(text: str) -> str:
    return text.replace("|", "\\|")


def render(settings: SimpleNamespace | None = None) -> str:
    settings = settings or load_settings()
    out = [
        "# Settings reference",
        "",
        "<!-- Generated by tools/docs/settings_reference.py from the packages' "
        "settings modules at build time; do not edit. -->",
        "",
        "Every environment variable of the plugin is declared once, by the package that "
        "reads it: the core in `spyre_inference.platform.settings`, each sub-package in "
        "its own `settings` module, published through the entry-point group "
        "`spyre_inference.settings`, from which the core collects them. Each is parsed "
        "once per process. An invalid value stops start-up with a message naming the "
        "variable and what it accepts; a variable that nearly spells a setting is "
        "reported as a likely typo. `spyre-inference-env` shows the values in force "
        "([diagnostics](../diagnostics.md)).",
        "",
        "| variable | default | accepted | declared by |",
        "|---|---|---|---|",
    ]
    for s in settings.SETTINGS:
        accepted = ", ".join(f"`{c}`" for c in s.choices) if s.choices else "see below"
        default = f"`{s.default}`" if s.default else "(empty)"
        owner = settings.owner[s.name]
        out.append(f"| [`{s.name}`](#{s.name.lower()}) | {default} | {accepted} | {owner} |")
    out.append("")
    for s in settings.SETTINGS:
        out += [f"## `{s.name}` {{#{s.name.lower()}}}", "", s.doc, ""]
        out.append(f"- default: `{s.default}`" if s.default else "- default: empty")
        if s.choices:
            out.append("- accepted: " + ", ".join(f"`{c}`" for c in s.choices))
        mods = readers(s.name)
        if mods:
            out.append("- read by: " + ", ".join(f"`{m}`" for m in mods))
        out.append("")
    out += [
        "## Other variables the plugin reads or sets",
        "",
        "Not the plugin's own settings: these belong to vLLM, torch or the OS, and the "
        "plugin reads (or, where marked, sets) them.",
        "",
        "| variable | where | what it does here |",
        "|---|---|---|",
    ]
    for name, (where, what) in OTHER_VARIABLES.items():
        out.append(f"| `{name}` | {where} | {_escape_cell(what)} |")
    out += [
        "",
        "## Build and test tooling",
        "",
        "Read by `scripts/serve.sh`, `scripts/test.sh`, `noxfile.py` and "
        "`tools/spyre_env.py`, never by the installed packages.",
        "",
        "| variable | meaning |",
        "|---|---|",
    ]
    for name, what in TOOL_VARIABLES.items():
        out.append(f"| `{name}` | {_escape_cell(what)} |")
    return "\n".join(out) + "\n"


if __name__ == "__main__":
    sys.stdout.write(render())
