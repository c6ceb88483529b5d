"""``spyre-inference-env`` in the full install: every package found, nothing missing."""

from __future__ import annotations

import importlib.metadata as md
import json
import subprocess
import sys
from pathlib import Path

PACKAGES = ("platform", "ops", "attention", "models", "comms")


def test_console_script_reports_the_full_set() -> None:
    script = Path(sys.executable).parent / "spyre-inference-env"
    done = subprocess.run(
        [str(script), "--json"], capture_output=True, text=True, timeout=300, check=True
    )
    report = json.loads(done.stdout)
    assert report["device_target"]["target"] == "cpu"
    assert report["vllm_platform"] == "spyre_inference.platform.platform.TorchSpyrePlatform"
    dists = report["distributions"]
    for name in ["spyre-inference", *(f"spyre-inference-{p}" for p in PACKAGES)]:
        assert dists[name]["version"] == md.version(name)
    eps = report["entry_points"]
    names = {group: {r["name"] for r in rows} for group, rows in eps.items()}
    assert names["vllm.platform_plugins"] == {"spyre"}
    assert {"spyre_ops", "spyre_models"} <= names["vllm.general_plugins"]
    assert names["spyre_inference.attention_backends"] == {"token_major", "head_major", "encoder"}
    assert names["spyre_inference.communicators"] == {"spyre"}
    assert {"spyre-inference-env", "spyre-prepare-default-model"} <= names["console_scripts"]
    assert all(r["status"] == "loads" for rows in eps.values() for r in rows)
    assert report["missing"] == {}
