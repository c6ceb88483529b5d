"""Alternated A/B of decode speed: the plugin's levers measured in one run.

Not a test: a measurement. Each *variant* is the plugin from a source tree (a
``git worktree`` of another commit, or this checkout) with optional settings
(environment variables). Variants run one after another in their own process,
in alternating order over ``--rounds`` rounds (A B, B A, A B, ...), so slow
drift of a 2-core VM falls on both; the report gives per-variant medians.

Per process (engine in-process, ``VLLM_ENABLE_V1_MULTIPROCESSING=0``; the
side-by-side benchmark's W1 workload and engine settings, the default model):

* ``w1 ms/token``: batch-1 decode, (full request - 1-token request) / decode
  tokens, median of ``--runs`` pairs;
* ``b32 ms/step``: 32 sequences decoding together, same difference method;
* with ``--proxies``: the Spyre cost proxies per decode step at batch 1
  (``sxs/proxies.py``), which do not depend on timing;
* zero compiles after warm-up is checked (a variant that compiles mid-run is
  reported, since its timings would include Inductor);
* ``weights MiB``: the model's parameters as loaded, plus the copies the cpu
  target keeps outside them (oneDNN-packed GEMM weights).

Run (``git worktree add /tmp/ab/base <commit>`` for another commit's tree)::

    scripts/test.sh -s perf -- decode_ab.py --variant base@/tmp/ab/base --variant new \\
        --variant new-graph:SPYRE_CPU_ATTN_KERNEL=graph --rounds 3

A variant is ``NAME[@TREE][:VAR=VALUE,...]`` (a value may hold commas:
``min8:SPYRE_NUM_TOKENS_BUCKETS=8,16,32``); without ``@TREE`` it runs this
checkout's code as installed. ``model=PATH`` among the settings gives the
variant its own checkpoint (a quantized one against the 16-bit model, say).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE / "sxs"))

#: Sequences of the batched decode measurement (W2's batch).
BATCH = 32


@dataclasses.dataclass(frozen=True)
class Variant:
    name: str
    tree: Path | None
    env: dict[str, str]
    #: This variant's checkpoint (``model=PATH`` in its settings), else ``--model``.
    model: str | None = None

    @classmethod
    def parse(cls, spec: str) -> Variant:
        head, _, settings = spec.partition(":")
        name, _, tree = head.partition("@")
        env = {}
        model = None
        # A chunk without "=" continues the previous value: list-valued settings
        # (SPYRE_NUM_TOKENS_BUCKETS=1,2,4) keep their commas.
        items: list[str] = []
        for chunk in filter(None, settings.split(",")):
            if "=" not in chunk and items:
                items[-1] += "," + chunk
            else:
                items.append(chunk)
        for item in items:
            key, sep, value = item.partition("=")
            if not sep:
                raise argparse.ArgumentTypeError(f"{spec!r}: {item!r} is not VAR=VALUE")
            if key == "model":
                model = value
            else:
                env[key] = value
        return cls(name, Path(tree).resolve() if tree else None, env, model)

    def environ(self) -> dict[str, str]:
        env = dict(os.environ)
        env.update(self.env)
        if self.tree is not None:
            srcs = sorted(str(p) for p in (self.tree / "packages").glob("*/src"))
            srcs.append(str(self.tree / "src"))
            env["PYTHONPATH"] = os.pathsep.join(srcs)
        return env


def _child(args: argparse.Namespace) -> dict[str, Any]:
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    import torch._dynamo.callback as cb
    import workloads as wl
    from vllm import LLM, SamplingParams

    import spyre_inference

    compiles = {"on": False, "n": 0}

    def _count(_args: Any) -> None:
        if compiles["on"]:
            compiles["n"] += 1

    cb.on_compile_start(_count)
    llm = LLM(model=args.model, **wl.ENGINE_ARGS)
    w1 = wl.W1.prompts()
    batch = [p[:16] for p in wl.W2.prompts()][:BATCH]

    def timed(prompts: list[list[int]], max_tokens: int) -> float:
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        t0 = time.perf_counter()
        llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        return time.perf_counter() - t0

    decode_b32 = 16
    for prompts, n in ((w1, wl.W1.output_len), (batch, 1 + decode_b32)):  # warm-up
        timed(prompts, 1)
        timed(prompts, n)
    compiles["on"] = True
    w1_ms, b32_ms = [], []
    for _ in range(args.runs):
        first = timed(w1, 1)
        w1_ms.append((timed(w1, wl.W1.output_len) - first) / (wl.W1.output_len - 1) * 1e3)
        first = timed(batch, 1)
        b32_ms.append((timed(batch, 1 + decode_b32) - first) / decode_b32 * 1e3)
    from engine_child import plugin_weight_bytes

    out: dict[str, Any] = {
        "tree": str(Path(spyre_inference.__path__[0]).parent),
        "weight_bytes": plugin_weight_bytes(llm),
        "w1_ms_per_token": w1_ms,
        "b32_ms_per_step": b32_ms,
        "compiles_after_warm_up": compiles["n"],
    }
    if args.proxies:
        import proxies

        out["proxies"] = proxies.measure(llm, w1, batch[:1], decode_steps=8)["batch 1"]
    llm.llm_engine.engine_core.shutdown()
    return out


def _run_variant(
    variant: Variant, model: str, runs: int, proxies: bool, work: Path, index: int
) -> dict[str, Any]:
    out = work / f"{variant.name}-{index}.json"
    cmd = [sys.executable, __file__, "--child", "--model", model, "--runs", str(runs)]
    cmd += ["--out", str(out)] + (["--proxies"] if proxies else [])
    log = work / f"{variant.name}-{index}.log"
    with open(log, "w") as fh:
        done = subprocess.run(cmd, env=variant.environ(), stdout=fh, stderr=subprocess.STDOUT)
    if done.returncode != 0:
        raise SystemExit(f"{variant.name} failed ({done.returncode}); log {log}")
    return json.loads(out.read_text())


def _report(variants: list[Variant], results: dict[str, list[dict[str, Any]]]) -> str:
    import cpu_class

    cpu, flags = cpu_class.read_cpuinfo()
    med = statistics.median
    lines = [
        f"CPU class `{cpu_class.classify(cpu, flags)['slug']}` ({cpu}), {os.cpu_count()} cores",
        "",
        "| variant | W1 ms/token (median) | runs | b32 ms/step (median) | weights MiB | "
        "compiles after warm-up | graph calls / eager ops per step |",
        "|---|---|---|---|---|---|---|",
    ]
    base = None
    for v in variants:
        rs = results[v.name]
        w1 = [x for r in rs for x in r["w1_ms_per_token"]]
        b32 = [x for r in rs for x in r["b32_ms_per_step"]]
        w1m, b32m = med(w1), med(b32)
        if base is None:
            base = (w1m, b32m)
        prox = next((r["proxies"] for r in rs if "proxies" in r), None)
        prox_s = f"{prox['compiled_graph_calls']:g} / {prox['eager_device_ops']:g}" if prox else "-"
        lines.append(
            f"| {v.name} | {w1m:.2f} ({w1m / base[0]:.2f}x) | {len(w1)} | "
            f"{b32m:.1f} ({b32m / base[1]:.2f}x) | {rs[0]['weight_bytes'] / 2**20:.0f} | "
            f"{sum(r['compiles_after_warm_up'] for r in rs)} "
            f"| {prox_s} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--variant", action="append", type=Variant.parse, default=[])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--runs", type=int, default=3, help="measured pairs per process")
    parser.add_argument("--proxies", action="store_true")
    parser.add_argument("--model", help="default: the prepared default model")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.model is None:
        from spyre_inference.default_model import default_model_dir, is_prepared

        args.model = str(default_model_dir())
        if not is_prepared(args.model):
            raise SystemExit("run spyre-prepare-default-model first")
    if args.child:
        args.out.write_text(json.dumps(_child(args)))
        return
    variants = args.variant or [Variant("current", None, {})]
    if len({v.name for v in variants}) != len(variants):
        raise SystemExit("variant names must differ")
    work = HERE.parent / "build" / "decode_ab"
    work.mkdir(parents=True, exist_ok=True)
    results: dict[str, list[dict[str, Any]]] = {v.name: [] for v in variants}
    for rnd in range(args.rounds):
        order = variants if rnd % 2 == 0 else variants[::-1]
        for v in order:
            model = v.model or args.model
            r = _run_variant(v, model, args.runs, args.proxies and rnd == 0, work, rnd)
            results[v.name].append(r)
            print(
                f"[ab] round {rnd} {v.name}: W1 {statistics.median(r['w1_ms_per_token']):.2f} "
                f"ms/token, b32 {statistics.median(r['b32_ms_per_step']):.1f} ms/step",
                file=sys.stderr,
                flush=True,
            )
    text = _report(variants, results)
    print(text)
    if args.json:
        args.json.write_text(json.dumps({"variants": [v.name for v in variants], **results}))


if __name__ == "__main__":
    main()
