"""vLLM's own ``tests/v1/sample/test_rejection_sampler.py`` against the platform's stand-ins.

Speculative decoding verifies drafts with vLLM's rejection sampler, whose
Triton kernels the platform replaces with PyTorch
(:mod:`spyre_inference.platform.rejection_kernels`). vLLM's test file checks
the sampler against its own pure-PyTorch references; it comes from the vLLM
sdist the environment tooling caches (``$SPYRE_INFERENCE_CACHE/sdist``) and
runs in a separate pytest process, with ``vllm_suite/spyre_rejection_overrides.py``
registering the overrides as a worker does.

Left out, by name: the FLy tests (``rejection_sample_method="fly"``), whose
entropy-gated acceptance launches Triton kernels the platform has no
stand-in for; the start-up checks refuse that method.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from spyre_inference.testing.vllm_tests import run_test_file

HERE = Path(__file__).resolve().parent / "vllm_suite"
TEST_FILE = "tests/v1/sample/test_rejection_sampler.py"
#: Deselected: what cannot run here (see the module docstring).
DESELECT = "fly"


@pytest.mark.timeout(1200)
def test_vllm_rejection_sampler_suite(tmp_path: Path) -> None:
    result = run_test_file(
        TEST_FILE,
        tmp_path,
        deselect=DESELECT,
        plugins=["spyre_rejection_overrides"],
        plugin_dirs=[HERE],
    )
    assert result.returncode == 0, f"vLLM's rejection sampler tests failed:\n{result.tail}"
    # The file has 82 tests in vLLM 0.33, 7 of them FLy: the rest must all run.
    assert result.passed >= 70, result.tail
