"""``spyre-inference-env`` in the full install: every package found, nothing missing.

Called in-process (``diagnostics.main``), which is what the console script
runs; that the script itself is installed and loads is checked by the nox
session's entry-point check (``tools/spyre_env.py check-dist``).
"""

from __future__ import annotations

import importlib.metadata as md
import json
import os

import pytest

from spyre_inference.platform import diagnostics

PACKAGES = ("platform", "ops", "attention", "models", "comms")


def test_report_lists_the_full_set(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("VLLM_CONFIGURE_LOGGING", raising=False)
    assert diagnostics.main(["--json"]) == 0
    # The report silences vLLM's logging only while it runs: a leak here once
    # turned off the logs of every `vllm serve` started later by this process.
    assert "VLLM_CONFIGURE_LOGGING" not in os.environ
    report = json.loads(capsys.readouterr().out)
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
