"""Soak: the load of ``tests/test_serve_load.py``, sustained for ten minutes.

Not a test: a measurement. One ``vllm serve`` of the tiny test Llama (float32,
the same arguments and compiled shapes as the test, from ``tests/load.py``)
is kept at 32 requests in flight by the official ``openai`` async client for
``--duration`` seconds. Each request is drawn from the test's mix (completions
and chat, streamed or not, prompts of 5..118 tokens, 1..32 output tokens);
besides the good requests, a small share is bad (the test's 4xx cases) and a
small share are streams the client cancels after two chunks.

Reported per ``--interval`` window: completed requests, output tokens per
second, bad requests answered 4xx, cancelled streams, failures, outputs that
differ from the same request sent alone before the soak, KV-cache usage from
``/metrics``, the resident memory (RSS) of the API server, of the engine
process(es) and in total, and the machine's load average (this host is shared;
a busy machine lowers throughput). Afterwards: peak RSS, RSS growth between
the first and the last window, whether the KV cache emptied, and whether the
server still answers.

Run::

    scripts/test.sh -s perf -- soak.py [--duration 600] [--interval 30]

Results go to ``benchmarks/results/soak.{json,md}``.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import platform
import random
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import psutil
import requests

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.load import (  # noqa: E402
    BAD_REQUESTS,
    CONCURRENCY,
    DISTINCT,
    MAX_TOKENS,
    MODEL,
    PROMPTS,
    SEED,
    SERVER_ARGS,
    SERVER_ENV,
    cancel_stream,
    client,
    metric,
    mixed_requests,
    send,
    send_bad,
    send_counted,
)
from tests.serving import serve  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"
BAD_SHARE = 0.04
CANCEL_SHARE = 0.04


@dataclasses.dataclass
class Window:
    """What happened in one interval of the soak."""

    start: float
    completed: int = 0
    tokens: int = 0
    bad_4xx: int = 0
    bad_other: int = 0
    cancelled: int = 0
    failed: int = 0
    mismatched: int = 0
    latencies: list[float] = dataclasses.field(default_factory=list)
    rss_mb: dict[str, float] = dataclasses.field(default_factory=dict)
    kv_usage_max: float = 0.0
    load_avg_1m: float = 0.0

    def summary(self, end: float) -> dict[str, Any]:
        span = end - self.start
        lat = sorted(self.latencies)
        return {
            "t_end_s": round(end, 1),
            "completed": self.completed,
            "tokens": self.tokens,
            "req_per_s": round(self.completed / span, 2),
            "output_tok_per_s": round(self.tokens / span, 1),
            "p50_latency_s": round(lat[len(lat) // 2], 2) if lat else None,
            "p95_latency_s": round(lat[int(len(lat) * 0.95)], 2) if lat else None,
            "bad_4xx": self.bad_4xx,
            "bad_not_4xx": self.bad_other,
            "cancelled": self.cancelled,
            "failed": self.failed,
            "mismatched": self.mismatched,
            "kv_usage_max": round(self.kv_usage_max, 3),
            "rss_mb": {k: round(v, 1) for k, v in self.rss_mb.items()},
            "load_avg_1m": round(self.load_avg_1m, 2),
        }


def server_rss_mb(pid: int) -> dict[str, float]:
    """RSS of the server process and of each process below it (engine core, workers)."""
    out: dict[str, float] = {}
    procs = [psutil.Process(pid), *psutil.Process(pid).children(recursive=True)]
    for proc in procs:
        try:
            name = proc.name()
            if proc.pid == pid:
                name = "api_server"
            elif "resource_tracker" in " ".join(proc.cmdline()):
                continue
            out[name] = out.get(name, 0.0) + proc.memory_info().rss / 2**20
        except psutil.Error:
            continue
    out["total"] = sum(out.values())
    return out


async def soak(srv, duration: float, interval: float) -> dict[str, Any]:
    api = client(srv.url("/v1"))
    # The test's distinct requests, each streamed or not at random below.
    drawn = mixed_requests(100, PROMPTS, MAX_TOKENS, seed=SEED, distinct=DISTINCT)
    pool = sorted({r.alone() for r in drawn}, key=repr)
    refs = {req.alone(): await send(api, MODEL, req.alone()) for req in pool}
    bad_cases = list(BAD_REQUESTS.values())

    t0 = time.monotonic()
    stop_at = t0 + duration
    windows = [Window(start=0.0)]
    rss_peak: dict[str, float] = {}

    async def worker(seed: int) -> None:
        rng = random.Random(seed)
        i = 0
        while time.monotonic() < stop_at:
            i += 1
            draw = rng.random()
            started = time.monotonic()
            try:
                if draw < BAD_SHARE:
                    endpoint, kwargs, needle = rng.choice(bad_cases)
                    status, message = await send_bad(api, endpoint, kwargs)
                    win = windows[-1]
                    if 400 <= status < 500 and needle in message:
                        win.bad_4xx += 1
                    else:
                        win.bad_other += 1
                    continue
                if draw < BAD_SHARE + CANCEL_SHARE:
                    await cancel_stream(api, MODEL, seed * 100_000 + i, after=2)
                    windows[-1].cancelled += 1
                    continue
                base = rng.choice(pool)
                req = dataclasses.replace(base, stream=rng.random() < 0.5)
                text, tokens = await send_counted(api, MODEL, req)
            except Exception:
                windows[-1].failed += 1
                continue
            win = windows[-1]
            win.completed += 1
            win.tokens += tokens
            win.latencies.append(time.monotonic() - started)
            if text != refs[req.alone()]:
                win.mismatched += 1

    def sample(win: Window) -> None:
        rss = server_rss_mb(srv.proc.pid)
        for name, mb in rss.items():
            win.rss_mb[name] = max(win.rss_mb.get(name, 0.0), mb)
            rss_peak[name] = max(rss_peak.get(name, 0.0), mb)
        try:
            text = requests.get(srv.url("/metrics"), timeout=10).text
            win.kv_usage_max = max(win.kv_usage_max, metric(text, "vllm:kv_cache_usage_perc"))
        except (requests.RequestException, KeyError):
            pass
        win.load_avg_1m = max(win.load_avg_1m, os.getloadavg()[0])

    async def sampler() -> list[dict[str, Any]]:
        done: list[dict[str, Any]] = []
        next_close = interval
        while time.monotonic() < stop_at:
            await asyncio.sleep(2.0)
            await asyncio.to_thread(sample, windows[-1])
            now = time.monotonic() - t0
            if now >= next_close:
                row = windows[-1].summary(now)
                done.append(row)
                print(json.dumps(row), flush=True)
                windows.append(Window(start=now))
                next_close += interval
        return done

    cpu_before = _cpu_seconds(srv.proc.pid)
    results = await asyncio.gather(sampler(), *(worker(s) for s in range(CONCURRENCY)))
    rows: list[dict[str, Any]] = results[0]
    wall = time.monotonic() - t0
    cpu_used = _cpu_seconds(srv.proc.pid) - cpu_before
    sample(windows[-1])
    last = windows[-1].summary(wall)
    if last["completed"]:
        rows.append(last)

    # After the load: the KV cache empties and the server still answers the same.
    kv_after = None
    for _ in range(60):
        text = requests.get(srv.url("/metrics"), timeout=10).text
        kv_after = metric(text, "vllm:kv_cache_usage_perc")
        if kv_after == 0 and metric(text, "vllm:num_requests_running") == 0:
            break
        await asyncio.sleep(1)
    probe = pool[0].alone()
    still_serving = await send(api, MODEL, probe) == refs[probe]
    await api.close()

    totals = {
        key: sum(r[key] for r in rows)
        for key in (
            "completed",
            "tokens",
            "bad_4xx",
            "bad_not_4xx",
            "cancelled",
            "failed",
            "mismatched",
        )
    }
    sampled = [r for r in rows if r["rss_mb"]]
    first, final = sampled[0]["rss_mb"], sampled[-1]["rss_mb"]
    return {
        "duration_s": round(wall, 1),
        "windows": rows,
        "totals": totals,
        "output_tok_per_s_overall": round(totals["tokens"] / wall, 1),
        "rss_peak_mb": {k: round(v, 1) for k, v in rss_peak.items()},
        "rss_growth_first_to_last_window_mb": {
            k: round(final.get(k, 0.0) - first.get(k, 0.0), 1) for k in first
        },
        "kv_usage_after": kv_after,
        "still_serving_same_answer": still_serving,
        "server_cpu_s": round(cpu_used, 1),
        "server_cpu_share_of_2_cores": round(cpu_used / wall / (os.cpu_count() or 1), 2),
    }


def _cpu_seconds(pid: int) -> float:
    total = 0.0
    for proc in [psutil.Process(pid), *psutil.Process(pid).children(recursive=True)]:
        try:
            times = proc.cpu_times()
            total += times.user + times.system
        except psutil.Error:
            continue
    return total


def tiny_llama(base: Path) -> Path:
    from spyre_inference.testing.models import build_tiny_model

    return build_tiny_model("llama", base / "llama")


def write_markdown(result: dict[str, Any], path: Path) -> None:
    rows = result["windows"]
    lines = [
        "# Soak: `vllm serve` under the reliability load",
        "",
        f"Run {result['date']} on {result['machine']}. {result['note']}",
        "",
        f"- duration {result['duration_s']} s at concurrency {CONCURRENCY}; "
        f"server start {result['server_start_s']} s",
        f"- totals: {result['totals']}",
        f"- output tokens/s overall: {result['output_tok_per_s_overall']}",
        f"- peak RSS (MiB): {result['rss_peak_mb']}",
        f"- RSS growth, first to last window (MiB): {result['rss_growth_first_to_last_window_mb']}",
        f"- KV-cache usage after the load: {result['kv_usage_after']}; still serving the "
        f"same answer: {result['still_serving_same_answer']}",
        f"- server CPU: {result['server_cpu_s']} s "
        f"({result['server_cpu_share_of_2_cores']} of the machine's cores)",
        f"- load average (1 min) before / after: {result['load_avg_before']} / "
        f"{result['load_avg_after']}",
        "",
        "| t (s) | done | req/s | out tok/s | p50 s | p95 s | 4xx | cancelled | failed "
        "| mismatched | KV max | RSS total MiB | RSS engine MiB | load 1m |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        engine = sum(v for k, v in r["rss_mb"].items() if k not in ("total", "api_server"))
        lines.append(
            f"| {r['t_end_s']} | {r['completed']} | {r['req_per_s']} | "
            f"{r['output_tok_per_s']} | {r['p50_latency_s']} | {r['p95_latency_s']} | "
            f"{r['bad_4xx']} | {r['cancelled']} | {r['failed']} | {r['mismatched']} | "
            f"{r['kv_usage_max']} | {r['rss_mb'].get('total', 0):.0f} | {engine:.0f} | "
            f"{r['load_avg_1m']} |"
        )
    path.write_text("\n".join(lines) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--duration", type=float, default=600.0)
    parser.add_argument("--interval", type=float, default=30.0)
    parser.add_argument("--note", default="", help="free text stored with the results")
    parser.add_argument("--out", type=Path, default=RESULTS / "soak")
    args = parser.parse_args()

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    load_before = [round(x, 2) for x in os.getloadavg()]
    with tempfile.TemporaryDirectory(prefix="soak-") as tmp:
        model = tiny_llama(Path(tmp))
        t_start = time.monotonic()
        with serve(model, SERVER_ARGS, env=SERVER_ENV, startup_timeout=1800) as srv:
            server_start = time.monotonic() - t_start
            print(f"server ready in {server_start:.1f} s", flush=True)
            result = asyncio.run(soak(srv, args.duration, args.interval))
    result.update(
        date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        machine=f"{platform.machine()}, {os.cpu_count()} cores, "
        f"{psutil.virtual_memory().total / 2**30:.0f} GiB",
        note=args.note,
        server_start_s=round(server_start, 1),
        load_avg_before=load_before,
        load_avg_after=[round(x, 2) for x in os.getloadavg()],
        server_args=list(SERVER_ARGS),
        server_env=SERVER_ENV,
    )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps(result, indent=2) + "\n")
    write_markdown(result, args.out.with_suffix(".md"))
    print(json.dumps({k: v for k, v in result.items() if k != "windows"}, indent=2))


if __name__ == "__main__":
    main()
