"""vLLM's own test files against the plugin (cpu target): the list in ``vllm_suite/suite.toml``.

Each ``pass`` file runs in its own pytest process from the cached vLLM sdist
(:mod:`spyre_inference.testing.vllm_tests`), with the hub models the
list names served from local tiny models. ``cannot-run`` files are listed with
their reason in ``docs/vllm-tests.md``; the test below keeps that page and the
list in step.
"""

from __future__ import annotations

import tomllib
from pathlib import Path

import pytest

from spyre_inference.testing.vllm_tests import run_test_file

SUITE = tomllib.loads((Path(__file__).parent / "vllm_suite" / "suite.toml").read_text())
DOC = Path(__file__).parents[1] / "docs" / "vllm-tests.md"
RUN_HERE = [f for f in SUITE["file"] if f["status"] == "pass" and not f.get("elsewhere")]


@pytest.mark.timeout(1200)
@pytest.mark.parametrize("entry", RUN_HERE, ids=[f["path"] for f in RUN_HERE])
def test_vllm_test_file_passes(entry, tiny_model_factory, tmp_path: Path) -> None:
    hub = {name: tiny_model_factory(kind) for name, kind in SUITE["hub_models"].items()}
    result = run_test_file(entry["path"], tmp_path, deselect=entry.get("deselect"), hub_models=hub)
    print(f"\n{entry['path']}: {result.passed} passed, {result.skipped} skipped")
    assert result.returncode == 0, f"{entry['path']} failed:\n{result.tail}"
    assert result.passed > 0, result.tail


def test_docs_list_every_file() -> None:
    page = DOC.read_text()
    for entry in SUITE["file"]:
        assert f"`{entry['path']}`" in page, f"docs/vllm-tests.md does not list {entry['path']}"
