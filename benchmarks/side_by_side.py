"""Side-by-side benchmark: the plugin (cpu target) vs vLLM's CPU backend vs transformers.

One command reproduces the whole comparison (``scripts/test.sh -s bench``, or
this file run by any Python >= 3.11 with the bootstrap venv's uv available):

1. makes/reuses one venv per system (:mod:`sxs.envs`);
2. measures the memory bandwidth (:mod:`sxs.membw`) before and after;
3. runs W1, W2 and the batch sweep offline in each system's venv
   (:mod:`sxs.engine_child`, :mod:`sxs.hf_child`), the plugin's Spyre cost
   proxies included;
4. checks every system's greedy outputs against float32 transformers
   (``hf_child check``): a wrong token from the plugin fails the command;
5. serves each vLLM system and measures W3 with ``vllm bench serve``
   (:mod:`sxs.serving`);
6. stores the run under its CPU class (:mod:`sxs.cpu_class`) in
   ``benchmarks/results/side_by_side.json``, replacing that class's previous
   run and keeping the others, and writes ``side_by_side.md`` with one section
   per class and ``throughput_vs_batch-<class>.svg``. Each class has its own
   hand-written analysis, ``sxs/analysis/<class>.md``.

Systems run one after another, never at once (2 cores). Nothing here is a test:
CI does not run it.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE / "sxs"))

import cpu_class  # noqa: E402
import envs  # noqa: E402
import report  # noqa: E402
import serving  # noqa: E402

RESULTS = HERE / "results"
#: Report name -> (kind, dtype). The first three are the issue's comparison
#: (all bfloat16); the float32 peers show what a user of those systems would
#: pick on a CPU without bfloat16 instructions (informational).
SYSTEMS: dict[str, tuple[str, str]] = {
    "plugin": ("plugin", "bfloat16"),
    "vllm-cpu": ("vllm-cpu", "bfloat16"),
    "transformers": ("transformers", "bfloat16"),
    "vllm-cpu fp32": ("vllm-cpu", "float32"),
    "transformers fp32": ("transformers", "float32"),
}
CHILDREN = HERE / "sxs"
#: Children's logs and raw JSON: kept out of git (build/ is ignored).
WORK = HERE.parent / "build" / "bench"
#: A 1-minute load average above this means other work shared the machine.
BUSY_LOAD = 2.5


def log(msg: str) -> None:
    print(f"[bench] {msg}", file=sys.stderr, flush=True)


def _run_child(python: Path, args: list[str], env: dict[str, str], log_path: Path) -> None:
    seconds = envs.run_child(python, args, env, log_path)
    log(f"{' '.join(args[:2])} finished in {seconds:.0f} s (log {log_path})")


def _machine() -> dict[str, Any]:
    cpu, flags = cpu_class.read_cpuinfo()
    wanted = cpu_class.LISTED_FLAGS
    mem_kib = 0
    with open("/proc/meminfo") as fh:
        for line in fh:
            if line.startswith("MemTotal"):
                mem_kib = int(line.split()[1])
    return {
        "cpu": cpu,
        "cpu_class": cpu_class.classify(cpu, flags),
        "cores": len(os.sched_getaffinity(0)),
        "isa": ", ".join(f for f in wanted if f in flags)
        + " (no "
        + ", ".join(f for f in wanted if f not in flags)
        + ")",
        "mem_gib": round(mem_kib / 2**20, 1),
        "kernel": platform.release(),
        "python": platform.python_version(),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs-w1", type=int, default=5)
    parser.add_argument("--runs-w2", type=int, default=3)
    parser.add_argument("--runs-w3", type=int, default=3)
    parser.add_argument("--runs-sweep", type=int, default=1)
    parser.add_argument(
        "--systems",
        default=",".join(SYSTEMS),
        help=f"comma-separated subset of {', '.join(SYSTEMS)}",
    )
    parser.add_argument(
        "--budget-s",
        type=float,
        default=600,
        help="per workload and system: no further run after this many seconds",
    )
    parser.add_argument(
        "--cap-s", type=float, default=900, help="abort a single run after this many seconds"
    )
    parser.add_argument("--skip-serving", action="store_true")
    parser.add_argument(
        "--report-only",
        action="store_true",
        help="rebuild side_by_side.md from side_by_side.json and sxs/analysis/",
    )
    parser.add_argument(
        "--recheck",
        action="store_true",
        help="score the last full run's saved greedy outputs (build/bench/outputs.json) "
        "with this checkout's check, then rebuild the report",
    )
    parser.add_argument("--out-dir", type=Path, default=RESULTS)
    args = parser.parse_args()
    if args.report_only:
        _write_report(_load_runs(args.out_dir), args.out_dir)
        return 0
    if args.recheck:
        return _recheck(args.out_dir)
    systems = [s for s in SYSTEMS if s in args.systems.split(",")]
    out_dir: Path = args.out_dir
    work = WORK
    work.mkdir(parents=True, exist_ok=True)
    loads: list[str] = []

    def phase(name: str) -> None:
        load = os.getloadavg()[0]
        loads.append(f"{name} {load:.1f}")
        log(f"{name} (load {load:.1f})")

    phase("setup")
    plugin_py = envs.plugin_venv()
    # The plugin runs on its default settings, with tcmalloc as its engines have it.
    plugin_env, plugin_tcmalloc = envs.plugin_env(plugin_py)
    model = envs.default_model(plugin_py, plugin_env)
    notes: list[str] = []
    hf_version = envs.installed_version(plugin_py, "transformers")
    pythons: dict[str, Path] = {"plugin": plugin_py}
    child_envs: dict[str, dict[str, str]] = {"plugin": plugin_env}
    described: dict[str, str] = {
        "plugin": f"spyre-inference {envs.installed_version(plugin_py, 'spyre-inference')} "
        f"on vLLM {envs.installed_version(plugin_py, 'vllm')}, cpu target, bfloat16, "
        "default settings"
        + (
            f", tcmalloc preloaded (`{plugin_tcmalloc}`, as the cpu target does for its "
            "engine processes)"
            if plugin_tcmalloc
            else ", no tcmalloc on this machine"
        )
    }
    for system in systems:
        kind, dtype = SYSTEMS[system]
        if kind == "vllm-cpu":
            python = envs.vllm_cpu_venv()
            env, vcpu_notes = envs.vllm_cpu_env(python)
            notes += [f"vllm-cpu: {n}" for n in vcpu_notes if n not in notes]
            described[system] = f"vllm-cpu {envs.installed_version(python, 'vllm-cpu')}, {dtype}"
        elif kind == "transformers":
            python = envs.transformers_venv(hf_version)
            env = envs.base_env(python)
            described[system] = f"transformers {hf_version} `generate`, batched, greedy, {dtype}"
        else:
            continue
        pythons[system], child_envs[system] = python, env

    bandwidth = []
    phase("bandwidth")
    bandwidth.append(_membw(plugin_py, plugin_env))

    engines: dict[str, Any] = {}
    common = [
        f"--runs-w1={args.runs_w1}",
        f"--runs-w2={args.runs_w2}",
        f"--runs-sweep={args.runs_sweep}",
        f"--budget-s={args.budget_s}",
        f"--cap-s={args.cap_s}",
        "--model",
        model,
    ]
    for system in systems:
        kind, dtype = SYSTEMS[system]
        phase(f"{system} offline")
        out = work / f"{system}.json"
        if kind == "transformers":
            cmd = [str(CHILDREN / "hf_child.py"), "bench", f"--dtype={dtype}"]
        else:
            cmd = [str(CHILDREN / "engine_child.py"), "--system", kind, f"--dtype={dtype}"]
            if kind == "plugin":
                cmd.append("--proxies")
        cmd += [*common, "--label", system, "--out", str(out)]
        _run_child(pythons[system], cmd, child_envs[system], work / f"{system}.log")
        engines[system] = json.loads(out.read_text())

    phase("check")
    outputs = {name: r["outputs"] for name, r in engines.items() if "outputs" in r}
    checker = pythons.get("transformers", pythons["plugin"])
    check, check_ok, summary, equal = _check(outputs, checker, model, work)

    serving_results: dict[str, Any] = {}
    if not args.skip_serving:
        for system in systems:
            kind, _dtype = SYSTEMS[system]
            if kind == "transformers":
                continue
            phase(f"{system} serving")
            serving_results[system] = serving.measure(
                system,
                kind,
                pythons[system],
                child_envs[system],
                plugin_py,
                model,
                work / "w3",
                args.runs_w3,
                budget_s=args.budget_s,
                dtype=_dtype,
            )
            log(f"{system} W3: {serving_results[system]['medians']}")

    phase("bandwidth again")
    bandwidth.append(_membw(plugin_py, plugin_env))
    phase("done")

    plugin_compiles = engines.get("plugin", {}).get("compiles_measured", 0) + engines.get(
        "plugin", {}
    ).get("compiles_proxies", 0)
    plugin_compiles += serving_results.get("plugin", {}).get("compiles_while_serving", 0)
    busy = any(float(x.split()[-1]) > BUSY_LOAD for x in loads)
    data = {
        "date": datetime.datetime.now().strftime("%Y-%m-%d %H:%M"),
        "command": " ".join(
            ["scripts/test.sh -s bench", *(["--", *sys.argv[1:]] if sys.argv[1:] else [])]
        ),
        "machine": _machine(),
        "systems": described,
        "bandwidth": bandwidth,
        "weight_bytes": report.weight_bytes(model),
        "loads": loads,
        "busy": busy,
        "engines": {
            k: {kk: vv for kk, vv in v.items() if kk != "outputs"} for k, v in engines.items()
        },
        "serving": serving_results,
        "check": check,
        "check_ok": check_ok,
        "check_summary": summary,
        "equal_to_transformers_generate": equal,
        "plugin_compiles": plugin_compiles,
        "notes": notes,
    }
    out_dir.mkdir(parents=True, exist_ok=True)
    runs = _load_runs(out_dir)
    runs[data["machine"]["cpu_class"]["slug"]] = data
    _save_runs(runs, out_dir)
    _write_report(runs, out_dir)
    if busy:
        log(f"the load average exceeded {BUSY_LOAD} during the run: re-run on an idle machine")
    if not check_ok:
        log("FAILED: the plugin's greedy outputs do not match transformers (see the report)")
        return 1
    return 0


def _load_runs(out_dir: Path) -> dict[str, dict[str, Any]]:
    """The stored runs by CPU class slug (a file from before classes holds one run)."""
    path = out_dir / "side_by_side.json"
    if not path.exists():
        return {}
    stored = json.loads(path.read_text())
    if "classes" not in stored:
        stored["machine"]["cpu_class"] = cpu_class.class_of_run(stored)
        stored = {"classes": {stored["machine"]["cpu_class"]["slug"]: stored}}
    return stored["classes"]


def _save_runs(runs: dict[str, dict[str, Any]], out_dir: Path) -> None:
    path = out_dir / "side_by_side.json"
    path.write_text(json.dumps({"classes": runs}, indent=1) + "\n")


def _write_report(runs: dict[str, dict[str, Any]], out_dir: Path) -> None:
    analyses = {}
    for slug in runs:
        analysis_file = CHILDREN / "analysis" / f"{slug}.md"
        analyses[slug] = analysis_file.read_text() if analysis_file.exists() else ""
    (out_dir / "side_by_side.md").write_text(report.build_all(runs, out_dir, analyses))
    log(f"report: {out_dir / 'side_by_side.md'}")


def _membw(python: Path, env: dict[str, str]) -> dict[str, Any]:
    done = subprocess.run(
        [str(python), str(CHILDREN / "membw.py")],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    return json.loads(done.stdout.strip().splitlines()[-1])


def _recheck(out_dir: Path) -> int:
    """Re-score the saved outputs of the last full run on this machine's CPU class;
    timings stay as measured."""
    runs = _load_runs(out_dir)
    data = runs[_machine()["cpu_class"]["slug"]]
    outputs = json.loads((WORK / "outputs.json").read_text())
    plugin_py = envs.plugin_venv()
    model = envs.default_model(plugin_py, envs.base_env(plugin_py))
    checker = envs.transformers_venv(envs.installed_version(plugin_py, "transformers"))
    check, check_ok, summary, equal = _check(outputs, checker, model, WORK)
    data.update(
        check=check, check_ok=check_ok, check_summary=summary, equal_to_transformers_generate=equal
    )
    when = datetime.datetime.now().strftime("%Y-%m-%d %H:%M")
    data["notes"].append(
        f"Outputs re-scored on {when} with the check as of that date (`--recheck`): "
        "the same greedy outputs, timings as measured on the run's date."
    )
    _save_runs(runs, out_dir)
    _write_report(runs, out_dir)
    if not check_ok:
        log("FAILED: the plugin's greedy outputs do not match transformers (see the report)")
        return 1
    return 0


def _check(
    outputs: dict[str, Any], checker: Path, model: str, work: Path
) -> tuple[dict[str, Any] | None, bool, str, dict[str, str]]:
    """Score every system's outputs with float32 transformers; the plugin may not be wrong."""
    if "plugin" not in outputs:
        return None, True, "plugin not run", {}
    (work / "outputs.json").write_text(json.dumps(outputs))
    out = work / "check.json"
    _run_child(
        checker,
        [str(CHILDREN / "hf_child.py"), "check", "--model", model, "--out", str(out),
         "--outputs", str(work / "outputs.json")],
        envs.base_env(checker),
        work / "check.log",
    )  # fmt: skip
    check = json.loads(out.read_text())
    plugin = check["systems"]["plugin"]
    wrong = sum(s["wrong"] for s in plugin.values())
    tokens = sum(s["tokens"] for s in plugin.values())
    argmax = sum(s["argmax_equal"] for s in plugin.values())
    summary = f"{argmax}/{tokens} tokens argmax, {tokens - argmax - wrong} near ties, {wrong} wrong"
    wide = sum(s.get("beyond_max_gap", 0) for s in plugin.values())
    if wide:
        summary += (
            f" ({wide} beyond {check['max_gap']} nats, within transformers' own bfloat16 error "
            "there)"
            if not wrong
            else f" ({wide} beyond {check['max_gap']} nats)"
        )
    equal: dict[str, str] = {}
    hf = outputs.get("transformers", {})
    for name in ("plugin", "vllm-cpu"):  # bfloat16 systems: float32 ones round differently
        mine = outputs.get(name, {})
        shared = [w for w in ("W1", "W2") if w in mine and w in hf]
        if shared:
            same = sum(a == b for w in shared for a, b in zip(mine[w], hf[w], strict=True))
            equal[name] = f"{same}/{sum(len(hf[w]) for w in shared)}"
    return check, wrong == 0, summary, equal


if __name__ == "__main__":
    sys.exit(main())
