"""vLLM's own test files against the plugin (cpu target): the list in ``vllm_suite/suite.toml``.

The ``pass`` files run together in one pytest process from the cached vLLM
sdist (:mod:`spyre_inference.testing.vllm_tests`; one vLLM import for all),
with the hub models the list names served from local tiny models; each file
is then judged on its own results. ``cannot-run`` files are listed with
their reason in ``docs/vllm-tests.md``; the test below keeps that page and the
list in step.
"""

from __future__ import annotations

import tomllib
from pathlib import Path

import pytest

from spyre_inference.testing.vllm_tests import FileResult, run_test_files

SUITE = tomllib.loads((Path(__file__).parent / "vllm_suite" / "suite.toml").read_text())
DOC = Path(__file__).parents[1] / "docs" / "vllm-tests.md"
RUN_HERE = [f for f in SUITE["file"] if f["status"] == "pass" and not f.get("elsewhere")]


@pytest.fixture(scope="module")
def suite_results(tiny_model_factory, tmp_path_factory) -> dict[str, FileResult]:
    hub = {name: tiny_model_factory(kind) for name, kind in SUITE["hub_models"].items()}
    files = {entry["path"]: entry.get("deselect") for entry in RUN_HERE}
    return run_test_files(files, tmp_path_factory.mktemp("vllm-suite"), hub_models=hub)


@pytest.mark.timeout(1200)
@pytest.mark.parametrize("entry", RUN_HERE, ids=[f["path"] for f in RUN_HERE])
def test_vllm_test_file_passes(entry, suite_results) -> None:
    result = suite_results[entry["path"]]
    print(f"\n{entry['path']}: {result.passed} passed, {result.skipped} skipped")
    assert result.returncode == 0, f"{entry['path']} failed:\n{result.tail}"
    assert result.passed > 0, result.tail


def test_docs_list_every_file() -> None:
    page = DOC.read_text()
    for entry in SUITE["file"]:
        assert f"`{entry['path']}`" in page, f"docs/vllm-tests.md does not list {entry['path']}"
