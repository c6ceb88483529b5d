"""vLLM's own ``tests/v1/attention/test_attention_backends.py`` against the token-major backend.

The test module comes from the vLLM sdist the environment tooling caches
beside the vLLM wheel (``$SPYRE_INFERENCE_CACHE/sdist``, default
``~/.cache/spyre-inference/sdist``); it is extracted into a temporary
directory and run by a separate pytest process with
``vllm_suite/spyre_vllm_suite_plugin.py``, which registers the backend as
vLLM's ``CUSTOM`` backend. The node ids run are listed, with the reasons for
what is left out, in ``vllm_suite/selection.txt``. A separate process keeps
vLLM's ``tests`` package apart from this repository's and runs the suite as
upstream runs it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tarfile
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
import vllm

HERE = Path(__file__).resolve().parent / "vllm_suite"
MODEL = "Qwen/Qwen3-0.6B"
SNAPSHOT = "0" * 40


def sdist_path() -> Path:
    cache = Path(os.environ.get("SPYRE_INFERENCE_CACHE") or "~/.cache/spyre-inference")
    version = vllm.__version__.split("+")[0]
    return cache.expanduser() / "sdist" / f"vllm-{version}.tar.gz"


def selected_nodes() -> list[str]:
    lines = (HERE / "selection.txt").read_text().splitlines()
    return [line.strip() for line in lines if line.strip() and not line.startswith("#")]


@pytest.fixture(scope="module")
def vllm_tests(tmp_path_factory) -> Path:
    sdist = sdist_path()
    if not sdist.is_file():
        pytest.fail(
            f"the vLLM sdist is not at {sdist}; the environment tooling (tools/spyre_env.py) "
            "caches it beside the vLLM wheel. Set SPYRE_INFERENCE_CACHE if it lives elsewhere."
        )
    root = tmp_path_factory.mktemp("vllm-sdist")
    prefix = sdist.name.removesuffix(".tar.gz")
    wanted = (f"{prefix}/tests/", f"{prefix}/pyproject.toml")
    with tarfile.open(sdist) as tar:
        members = [m for m in tar.getmembers() if m.name.startswith(wanted)]
        tar.extractall(root, members=members, filter="data")
    return root / prefix


@pytest.fixture(scope="module")
def offline_hf_home(tmp_path_factory) -> Path:
    """An HF cache holding only Qwen3-0.6B's published config.json (the test reads no weights)."""
    home = tmp_path_factory.mktemp("hf-home")
    repo = home / "hub" / ("models--" + MODEL.replace("/", "--"))
    snapshot = repo / "snapshots" / SNAPSHOT
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").write_text((HERE / "qwen3-0.6b-config.json").read_text())
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(SNAPSHOT)
    return home


@pytest.mark.slow
@pytest.mark.timeout(3600)
def test_vllm_attention_backends_suite(vllm_tests, offline_hf_home, tmp_path):
    nodes = selected_nodes()
    junit = tmp_path / "junit.xml"
    report = tmp_path / "report.json"
    env = dict(os.environ)
    env.update(
        HF_HOME=str(offline_hf_home),
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        SPYRE_VLLM_SUITE_REPORT=str(report),
        PYTHONPATH=os.pathsep.join(filter(None, [str(HERE), env.get("PYTHONPATH")])),
    )
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "--noconftest",
            "-p",
            "spyre_vllm_suite_plugin",
            "-c",
            "pyproject.toml",
            "--rootdir",
            ".",
            "-q",
            "-p",
            "no:cacheprovider",
            f"--junitxml={junit}",
            *nodes,
        ],
        cwd=vllm_tests,
        env=env,
        capture_output=True,
        text=True,
    )
    tail = "\n".join((proc.stdout + proc.stderr).splitlines()[-60:])
    assert proc.returncode == 0, f"vLLM's attention suite failed:\n{tail}"
    suite = ET.parse(junit).getroot()
    suite = suite if suite.tag == "testsuite" else suite.find("testsuite")
    counts = {k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")}
    assert counts == {"tests": len(nodes), "failures": 0, "errors": 0, "skipped": 0}, tail
    # The comparisons ran the Spyre kernels (compiled per bucket; on the cpu
    # target decode batches go through the host decode kernel), not another backend.
    evidence = json.loads(report.read_text())
    assert evidence["custom_backend"].endswith("token_major.SpyreAttentionBackend")
    assert evidence["page_attention_variants"] > 0
    assert evidence["batched_decode_variants"] > 0 or evidence["host_decode_calls"] > 0
