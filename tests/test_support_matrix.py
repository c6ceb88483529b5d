"""``tools/support_matrix.py``: the support matrix is built from junit XML, not by hand.

No engine: a synthetic junit file exercises every status, and the test files of
the repository are scanned so that a ``feature`` marker can never name a
feature the catalogue does not list.
"""

from __future__ import annotations

import ast
import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parent.parent

#: The scope of issue 8, each of which must be a row of the matrix.
ISSUE_8 = {
    "prefix_caching", "chunked_prefill", "preemption", "temperature", "top_p", "top_k",
    "min_p", "seed", "penalties", "n", "logprobs", "prompt_logprobs", "stop_strings",
    "stop_token_ids", "max_tokens", "min_tokens", "ignore_eos", "structured_json",
    "structured_regex", "structured_choice", "structured_json_chat_api", "long_context",
    "prompt_over_max_model_len", "beam_search", "chat",
}  # fmt: skip


@pytest.fixture(scope="module")
def tool() -> ModuleType:
    spec = importlib.util.spec_from_file_location(
        "support_matrix", ROOT / "tools" / "support_matrix.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses resolve annotations through it
    spec.loader.exec_module(module)
    return module


def _marker_ids(path: Path) -> set[str]:
    """Feature ids named by ``*.mark.feature("id", ...)`` in a test file."""
    ids = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr == "feature"
        ):
            ids |= {a.value for a in node.args if isinstance(a, ast.Constant)}
    return ids


def test_catalogue_lists_issue_8_and_every_marked_feature(tool) -> None:
    known = {f.id for f in tool.FEATURES}
    assert ISSUE_8 <= known, ISSUE_8 - known
    test_files = [*ROOT.glob("tests/**/test_*.py"), *ROOT.glob("packages/*/tests/**/test_*.py")]
    marked = set().union(*(_marker_ids(p) for p in test_files))
    assert ISSUE_8 <= marked, f"issue 8 features without a marked test: {ISSUE_8 - marked}"
    assert marked <= known, f"marker ids missing from the catalogue: {marked - known}"


JUNIT = """<?xml version="1.0" encoding="utf-8"?>
<testsuites><testsuite name="pytest" tests="5">
 <testcase classname="tests.features.test_feature_sampling" name="test_a" time="1.0">
  <properties><property name="feature" value="top_k"/><property name="worst" value="1e-06"/>
  </properties></testcase>
 <testcase classname="tests.features.test_feature_sampling" name="test_b[x]" time="1.0">
  <properties><property name="feature" value="top_k"/><property name="feature" value="n"/>
  </properties><failure message="boom">trace</failure></testcase>
 <testcase classname="tests.features.test_feature_sampling" name="test_c" time="0.1">
  <properties><property name="feature" value="seed"/></properties>
  <skipped message="needs a Spyre card"/></testcase>
 <testcase classname="tests.test_startup_errors" name="test_data_parallel_is_rejected"
  time="2.0"/>
 <testcase classname="tests.test_generate_vs_hf" name="test_greedy_equals_hf[llama]"
  time="3.0"/>
</testsuite></testsuites>
"""


def _status_of(page: str, title: str) -> str:
    row = next(line for line in page.splitlines() if line.startswith(f"| {title} |"))
    return row.split(" | ")[2]


def test_statuses_come_from_the_results(tool, tmp_path: Path) -> None:
    junit = tmp_path / "e2e.xml"
    junit.write_text(JUNIT)
    out = tmp_path / "matrix.md"
    assert tool.main([str(junit), "-o", str(out)]) == 0
    page = out.read_text()
    title = {f.id: f.title for f in tool.FEATURES}
    assert _status_of(page, title["top_k"]) == "FAILED"  # one of two failed
    assert _status_of(page, title["n"]) == "FAILED"
    assert _status_of(page, title["seed"]) == "skipped"
    assert _status_of(page, title["data_parallel"]) == "refused clearly"
    assert _status_of(page, title["model_llama"]) == "passed"  # by node-id pattern
    assert _status_of(page, title["op_linear"]) == "not run"  # ops session absent
    assert _status_of(page, title["multimodal"]) == "not run"  # its test is not in the run
    untested = tool.Feature("x", "Engine features", "a feature without tests", "spec")
    assert tool.status(untested, []) == "not tested"
    assert "needs a Spyre card" in page
    assert "measured: worst=1e-06" in page  # figures recorded with record_property
    assert "Run: `e2e` (undated: 1 failed, 3 passed, 1 skipped)" in page


def test_unknown_marker_id_is_an_error(tool, tmp_path: Path) -> None:
    junit = tmp_path / "e2e.xml"
    junit.write_text(JUNIT.replace('value="seed"', 'value="no_such_feature"'))
    assert tool.main([str(junit), "-o", str(tmp_path / "m.md")]) == 1


def test_node_ids_are_rebuilt_from_junit_classnames(tool) -> None:
    assert (
        tool._nodeid("tests.features.test_feature_sampling", "test_x[a]", ROOT)
        == "tests/features/test_feature_sampling.py::test_x[a]"
    )
    assert (
        tool._nodeid("packages.spyre-inference-ops.tests.test_linear.TestX", "test_y", ROOT)
        == "packages/spyre-inference-ops/tests/test_linear.py::TestX::test_y"
    )
