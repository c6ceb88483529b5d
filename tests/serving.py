"""Start `vllm serve` as a subprocess for end-to-end tests and stop it afterwards."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import requests


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    def __init__(self, port: int, proc: subprocess.Popen, log_path: Path) -> None:
        self.port = port
        self.proc = proc
        self.log_path = log_path
        self.base_url = f"http://127.0.0.1:{port}"

    def url(self, path: str) -> str:
        return self.base_url + path

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")


@contextlib.contextmanager
def serve(
    model: str | os.PathLike[str],
    args: Sequence[str] = (),
    *,
    env: dict[str, str] | None = None,
    startup_timeout: float = 600.0,
) -> Iterator[Server]:
    """Run ``vllm serve model *args`` until it answers /health, yield, then stop it."""
    port = free_port()
    log = Path(tempfile.mkstemp(prefix="vllm-serve-", suffix=".log")[1])
    cmd = [
        sys.executable, "-m", "vllm.entrypoints.cli.main", "serve", str(model),
        "--host", "127.0.0.1", "--port", str(port), *args,
    ]  # fmt: skip
    full_env = {**os.environ, "VLLM_NO_USAGE_STATS": "1", "HF_HUB_OFFLINE": "1", **(env or {})}
    with log.open("w") as out:
        proc = subprocess.Popen(
            cmd, stdout=out, stderr=subprocess.STDOUT, env=full_env, start_new_session=True
        )
    server = Server(port, proc, log)
    try:
        deadline = time.monotonic() + startup_timeout
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"vllm serve exited with {proc.returncode}:\n{server.log()}")
            try:
                if requests.get(server.url("/health"), timeout=2).status_code == 200:
                    break
            except requests.RequestException:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"vllm serve not ready in {startup_timeout} s:\n{server.log()}")
            time.sleep(1)
        yield server
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
