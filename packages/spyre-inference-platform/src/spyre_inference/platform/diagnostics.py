"""``spyre-inference-env``: what this installation of the plugin will do, for bug reports.

Like ``vllm collect-env``, but about the plugin: which device target it picks
and why, the versions of vLLM, torch, torch-spyre and each spyre-inference
distribution, the entry points vLLM and the core will find (and whether each
one loads), the settings in force with where each value came from, and the
other environment variables the plugin reads or honours. Nothing is changed:
the report reads the environment the way the plugin reads it at start-up.

``--json`` prints the same report as one JSON object (for scripts and tests).
"""

from __future__ import annotations

import argparse
import importlib.metadata as md
import json
import os
import platform as py_platform
import sys
from collections.abc import Sequence
from typing import Any

#: Distributions whose versions matter for a report, in this order.
VERSIONED = ("vllm", "torch", "torch-spyre", "transformers")
#: Entry-point groups vLLM reads for plugins; the core's own groups are every
#: group whose name starts with ``spyre_inference.``.
VLLM_GROUPS = ("vllm.platform_plugins", "vllm.general_plugins")
#: Environment variables outside the plugin's settings that change what it does.
RELATED_ENV = (
    "VLLM_PLUGINS",
    "VLLM_LOGGING_LEVEL",
    "VLLM_DISABLE_COMPILE_CACHE",
    "VLLM_WORKER_MULTIPROC_METHOD",
    "VLLM_ENABLE_V1_MULTIPROCESSING",
    "OMP_NUM_THREADS",
    "TORCHINDUCTOR_CACHE_DIR",
    "XDG_CACHE_HOME",
    "HF_HUB_OFFLINE",
    "TRANSFORMERS_OFFLINE",
)
PROJECT_PREFIX = "spyre-inference"


def _version(dist: str) -> str | None:
    try:
        return md.version(dist)
    except md.PackageNotFoundError:
        return None


def project_distributions() -> dict[str, dict[str, str]]:
    """Every installed spyre-inference distribution: version and where it lives."""
    found: dict[str, dict[str, str]] = {}
    for dist in md.distributions():
        name = (dist.metadata["Name"] or "").lower().replace("_", "-")
        if name == PROJECT_PREFIX or name.startswith(PROJECT_PREFIX + "-"):
            direct = dist.read_text("direct_url.json") or ""
            editable = '"editable": true' in direct.replace("'", '"')
            found[name] = {
                "version": dist.version,
                "location": str(dist.locate_file("")),
                "install": "editable" if editable else "regular",
            }
    return dict(sorted(found.items()))


def _groups() -> list[str]:
    names = {g for g in md.entry_points().groups if g.startswith("spyre_inference.")}
    return [*VLLM_GROUPS, *sorted(names)]


def entry_points_report() -> dict[str, list[dict[str, str]]]:
    """Entry points of the plugin groups (and the project's console scripts), loaded once each.

    Loading imports the target module without calling anything, which is what
    vLLM and the core do first; an import error here is the one they would hit.
    """
    report: dict[str, list[dict[str, str]]] = {}
    groups = [*_groups(), "console_scripts"]
    for group in groups:
        rows = []
        for ep in sorted(md.entry_points(group=group), key=lambda e: e.name):
            dist = ep.dist.name if ep.dist is not None else "?"
            if group == "console_scripts" and not ep.value.startswith("spyre_inference."):
                continue
            try:
                ep.load()
                status = "loads"
            except Exception as exc:  # reported, not raised: this is a diagnostic
                status = f"FAILS: {type(exc).__name__}: {exc}"
            rows.append({"name": ep.name, "value": ep.value, "dist": dist, "status": status})
        report[group] = rows
    return report


def missing_providers(entry_points: dict[str, list[dict[str, str]]]) -> dict[str, str]:
    """Core groups nobody fills, with the distribution that would."""
    from spyre_inference.platform.discovery import PROVIDERS

    return {group: dist for group, dist in PROVIDERS.items() if not entry_points.get(group)}


def settings_report() -> list[dict[str, Any]]:
    """Each plugin setting: the raw value, where it came from, and what the plugin parses."""
    from spyre_inference.platform import settings

    rows = []
    for s in settings.all_settings():
        source = "environment" if s.name in os.environ else "default"
        row: dict[str, Any] = {"name": s.name, "raw": os.environ.get(s.name, s.default)}
        row["source"] = source
        try:
            value = s.read()
            row["value"] = list(value) if isinstance(value, tuple) else value
        except settings.SettingError as exc:
            row["error"] = str(exc)
        rows.append(row)
    return rows


def target_report() -> dict[str, str]:
    """The device target this process would pick, and why (without caching the choice)."""
    from spyre_inference.platform import device, settings

    try:
        choice = device.target_choice.__wrapped__()
    except (RuntimeError, settings.SettingError) as exc:
        return {"target": "none", "reason": str(exc)}
    return {"target": choice.target.value, "reason": choice.reason}


def host_report() -> dict[str, Any]:
    """What the cpu target's speed depends on: cores available and bf16 support."""
    flags: set[str] = set()
    model = ""
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                key, _, value = line.partition(":")
                if key.strip() == "flags" and not flags:
                    flags = set(value.split())
                elif key.strip() == "model name" and not model:
                    model = value.strip()
    except OSError:
        pass
    import torch

    return {
        "python": f"{py_platform.python_version()} ({sys.executable})",
        "os": py_platform.platform(),
        "cpu": model or py_platform.processor(),
        "cpus_usable": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        # The cpu target computes in bfloat16: fast only with these instructions.
        "vector_instructions": sorted(
            flags & {"avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile"}
        ),
        "torch_threads": torch.get_num_threads(),
    }


def _is_torch_default_cache(path: str | None) -> bool:
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    return path is not None and os.path.abspath(path) == os.path.abspath(default_cache_dir())


def inductor_cache_report(env: dict[str, str | None]) -> str:
    """Where compiled graphs will be cached, decided as ``block_compile`` decides it.

    A ``TORCHINDUCTOR_CACHE_DIR`` equal to torch's own default counts as unset
    (torch writes its default into the variable when first asked for it).
    """
    from spyre_inference.platform.block_compile import default_inductor_cache_dir

    current = env.get("TORCHINDUCTOR_CACHE_DIR")
    if current is None or _is_torch_default_cache(current):
        return f"{default_inductor_cache_dir()} (the plugin's default)"
    return f"{current} (TORCHINDUCTOR_CACHE_DIR)"


def vllm_platform_report() -> str:
    """The platform vLLM itself resolves (runs vLLM's platform-plugin selection)."""
    try:
        from vllm.platforms import current_platform

        cls = type(current_platform)
        return f"{cls.__module__}.{cls.__qualname__}"
    except Exception as exc:
        return f"FAILS: {type(exc).__name__}: {exc}"


def collect() -> dict[str, Any]:
    # First, before anything imports torch (which sets TORCHINDUCTOR_CACHE_DIR).
    env = {name: os.environ.get(name) for name in RELATED_ENV}
    eps = entry_points_report()
    return {
        "device_target": target_report(),
        "vllm_platform": vllm_platform_report(),
        "versions": {name: _version(name) for name in VERSIONED},
        "distributions": project_distributions(),
        "entry_points": eps,
        "missing": missing_providers(eps),
        "settings": settings_report(),
        "related_env": env,
        "inductor_cache": inductor_cache_report(env),
        "host": host_report(),
    }


def render(report: dict[str, Any]) -> str:
    out: list[str] = []
    add = out.append
    target = report["device_target"]
    add("== device target")
    add(f"  {target['target']}: {target['reason']}")
    add(f"  vLLM's current_platform: {report['vllm_platform']}")
    add("== versions")
    for name, version in report["versions"].items():
        add(f"  {name:<32} {version or 'not installed'}")
    for name, info in report["distributions"].items():
        add(f"  {name:<32} {info['version']} ({info['install']}, {info['location']})")
    add("== entry points")
    for group, rows in report["entry_points"].items():
        add(f"  [{group}]")
        for row in rows:
            add(f"    {row['name']} = {row['value']}  ({row['dist']}; {row['status']})")
        if not rows:
            add("    (none)")
    for group, dist in report["missing"].items():
        add(f"  nothing fills [{group}]: pip install {dist} to get it")
    add("== settings (spyre_inference.platform.settings)")
    for row in report["settings"]:
        shown = row.get("value", row.get("error"))
        add(f"  {row['name']:<28} = {row['raw']!r:<14} {row['source']:<11} -> {shown!r}")
    add("== related environment")
    for name, value in report["related_env"].items():
        shown = "(unset)" if value is None else repr(value)
        if name == "TORCHINDUCTOR_CACHE_DIR" and _is_torch_default_cache(value):
            shown += " (torch's default, set by torch itself: counts as unset)"
        add(f"  {name:<32} {shown}")
    add(f"  compiled graphs are cached in {report['inductor_cache']}")
    add("== host")
    for key, value in report["host"].items():
        add(f"  {key:<32} {value}")
    return "\n".join(out)


def main(argv: Sequence[str] | None = None) -> int:
    """Console script ``spyre-inference-env``."""
    parser = argparse.ArgumentParser(
        prog="spyre-inference-env",
        description="Report the spyre-inference plugin's device target, versions, "
        "entry points and settings (for bug reports).",
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args(argv)
    # vLLM's logger writes INFO lines to stdout; the report is the only output
    # wanted. Restored afterwards: a caller that runs main() in-process (the
    # tests do) must not pass the setting on to the vLLM servers it starts later.
    previous = os.environ.get("VLLM_CONFIGURE_LOGGING")
    os.environ.setdefault("VLLM_CONFIGURE_LOGGING", "0")
    try:
        report = collect()
    finally:
        if previous is None:
            os.environ.pop("VLLM_CONFIGURE_LOGGING", None)
    print(json.dumps(report, indent=2) if args.json else render(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
