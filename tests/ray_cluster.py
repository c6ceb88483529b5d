"""A one-node Ray cluster that a test starts with ``ray start`` and stops afterwards.

As an operator starts a node: from the command line, declaring its ``spyre``
units (``ray start`` does not load the plugin, so it cannot detect them), and
with no ``SPYRE_*`` variable in its environment, so a worker has the engine's
settings only if the engine hands them over. Loopback only, and without Ray's
token authentication (nothing to hand to the engine's processes).
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

from tests.serving import free_port


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SPYRE_")}
    return {**env, "RAY_AUTH_MODE": "disabled"}


def client_env(address: str) -> dict[str, str]:
    """What a process that runs an engine on the cluster needs in its environment."""
    return {"RAY_ADDRESS": address, "RAY_AUTH_MODE": "disabled"}


@contextlib.contextmanager
def ray_cluster(units: int, num_cpus: int = 2) -> Iterator[str]:
    """Start the head node with ``units`` of ``spyre``; yield its address; stop it."""
    ray_cli = str(Path(sys.executable).parent / "ray")
    port = free_port()
    # Ray's socket paths must stay short: a temp dir under /tmp, not pytest's.
    temp_dir = tempfile.mkdtemp(prefix="ray-", dir="/tmp")
    cmd = [
        ray_cli, "start", "--head", "--node-ip-address", "127.0.0.1", "--port", str(port),
        "--num-cpus", str(num_cpus), "--resources", f'{{"spyre": {units}}}',
        "--include-dashboard", "false", "--disable-usage-stats", "--temp-dir", temp_dir,
    ]  # fmt: skip
    subprocess.run(cmd, check=True, capture_output=True, timeout=120, env=_env())
    try:
        yield f"127.0.0.1:{port}"
    finally:
        subprocess.run([ray_cli, "stop", "--force"], capture_output=True, timeout=120, env=_env())
