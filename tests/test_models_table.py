"""``tools/models_table.py``: the verified-model table is built from junit XML.

No engine: every architecture the models package registers must have a row,
every row's test patterns must name test files that exist, and a synthetic
junit file shows statuses coming from the results.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def tool() -> ModuleType:
    spec = importlib.util.spec_from_file_location(
        "models_table", ROOT / "tools" / "models_table.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def test_every_registered_architecture_has_a_row(tool) -> None:
    from spyre_inference.models import (
        TRANSFORMERS_TEXT_GENERATORS,
        spyre_models,
        transformers_backend_archs,
    )

    rows = {m.architecture for m in tool.MODELS}
    # The names vLLM itself maps to its Transformers backend classes are adapted by
    # those classes (their rows); those a test runs by name have rows of their own.
    by_backend = set(transformers_backend_archs()) - TRANSFORMERS_TEXT_GENERATORS
    missing = set(spyre_models()) - by_backend - rows
    assert not missing, f"architectures the models package registers without a row: {missing}"


def test_every_pattern_names_an_existing_test_file(tool) -> None:
    for model in tool.MODELS:
        for pattern in model.tests:
            path = pattern.split("::", 1)[0]
            assert (ROOT / path).is_file(), (model.architecture, pattern)


JUNIT = """<?xml version="1.0" encoding="utf-8"?>
<testsuites><testsuite name="pytest" tests="3">
 <testcase classname="tests.test_generate_vs_hf" name="test_greedy_equals_hf[llama]" time="3"/>
 <testcase classname="tests.test_generate_vs_hf" name="test_greedy_equals_hf[granite]" time="3">
  <failure message="boom">trace</failure></testcase>
 <testcase classname="packages.spyre-inference-models.tests.test_gpt_oss"
  name="test_gpt_oss_greedy_equals_hf" time="3"><skipped message="why"/></testcase>
</testsuite></testsuites>
"""


def _status(page: str, architecture: str) -> str:
    row = next(line for line in page.splitlines() if line.startswith(f"| `{architecture}` |"))
    return row.split(" | ")[5]


def test_statuses_come_from_the_results(tool, tmp_path: Path, monkeypatch) -> None:
    # A catalogue row without tests (an architecture the suite does not cover).
    untested = tool.Model("UntestedForCausalLM", "none in the suite", "", "", "", ())
    monkeypatch.setattr(tool, "MODELS", (*tool.MODELS, untested))
    junit = tmp_path / "e2e.xml"
    junit.write_text(JUNIT)
    out = tmp_path / "models.md"
    assert tool.main([str(junit), "-o", str(out)]) == 0
    page = out.read_text()
    assert _status(page, "LlamaForCausalLM") == "passed"
    assert _status(page, "GraniteForCausalLM") == "FAILED"
    assert _status(page, "GptOssForCausalLM") == "skipped"
    assert _status(page, "Qwen2ForCausalLM") == "not run"
    assert _status(page, "UntestedForCausalLM") == "not tested"
    assert "without a test in the suite: 1 (UntestedForCausalLM)." in page
