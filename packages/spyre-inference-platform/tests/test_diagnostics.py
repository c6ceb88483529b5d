"""``spyre-inference-env`` reports what is installed and in force, read independently here.

Runs in the platform session (only the core installed: the attention and comms
groups are empty and must be reported as missing) and in a full install alike:
every expectation is computed from ``importlib.metadata`` and the settings
table, not hard-coded.
"""

from __future__ import annotations

import importlib.metadata as md
import json

import pytest

from spyre_inference.platform import __version__, device, diagnostics, settings
from spyre_inference.platform.discovery import PROVIDERS


@pytest.fixture
def env(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("SPYRE_DEVICE_TARGET", "cpu")
    monkeypatch.setenv("SPYRE_NUM_TOKENS_BUCKETS", "16,8")
    monkeypatch.setenv("SPYRE_SETTLED_GUARDS", "maybe")  # invalid: reported, not raised
    monkeypatch.delenv("SPYRE_COMPILE_GRANULARITY", raising=False)
    device.reset_for_tests()
    yield
    monkeypatch.undo()
    device.reset_for_tests()


def test_report(env) -> None:
    report = diagnostics.collect()

    assert report["device_target"] == {
        "target": "cpu",
        "reason": "forced by SPYRE_DEVICE_TARGET=cpu",
    }
    assert report["vllm_platform"] == "spyre_inference.platform.platform.TorchSpyrePlatform"
    assert report["versions"]["vllm"] == md.version("vllm")
    assert report["versions"]["torch"] == md.version("torch")
    assert report["distributions"]["spyre-inference-platform"]["version"] == __version__

    # Every setting of the table, in order, with its source and parsed value.
    rows = {r["name"]: r for r in report["settings"]}
    assert list(rows) == [s.name for s in settings.all_settings()]
    assert rows["SPYRE_NUM_TOKENS_BUCKETS"]["source"] == "environment"
    assert rows["SPYRE_NUM_TOKENS_BUCKETS"]["value"] == [8, 16]
    error = rows["SPYRE_SETTLED_GUARDS"]["error"]
    assert "SPYRE_SETTLED_GUARDS='maybe' is not a valid value" in error
    assert rows["SPYRE_COMPILE_GRANULARITY"] == {
        "name": "SPYRE_COMPILE_GRANULARITY",
        "raw": "block",
        "source": "default",
        "value": "block",
    }

    # Entry points: exactly what importlib.metadata finds, each loaded.
    eps = report["entry_points"]
    for group in ("vllm.platform_plugins", "vllm.general_plugins", *PROVIDERS):
        assert group in eps or not md.entry_points(group=group)
        names = sorted(ep.name for ep in md.entry_points(group=group))
        assert [r["name"] for r in eps.get(group, [])] == names
    assert {"name": "spyre", "value": "spyre_inference.platform:register"}.items() <= eps[
        "vllm.platform_plugins"
    ][0].items()
    assert all(r["status"] == "loads" for rows_ in eps.values() for r in rows_)
    scripts = {r["name"] for r in eps["console_scripts"]}
    assert "spyre-inference-env" in scripts
    assert report["missing"] == {
        group: dist for group, dist in PROVIDERS.items() if not md.entry_points(group=group)
    }


def test_render_and_json(env, capsys: pytest.CaptureFixture[str]) -> None:
    assert diagnostics.main(["--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    text = diagnostics.render(report)
    for section in ("device target", "versions", "entry points", "settings", "host"):
        assert f"== {section}" in text
    for s in settings.all_settings():
        assert s.name in text
    assert "cpu: forced by SPYRE_DEVICE_TARGET=cpu" in text
    for group, dist in report["missing"].items():
        assert f"nothing fills [{group}]: pip install {dist}" in text
