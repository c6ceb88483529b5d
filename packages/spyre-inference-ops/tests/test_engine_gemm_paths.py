"""Every cpu-target GEMM path, forced one at a time, through the engine: same tokens.

The path a bfloat16 linear takes on the cpu target is chosen once at start-up
from the CPU (``device.has_fast_16bit_gemm``, ``native_build.select_isa``):
the host kernel's AVX2 or AVX-512 build, float32 weight copies with torch's
GEMM, or, where the CPU has the instructions, oneDNN on weights prepacked at
load (``SPYRE_CPU_GEMM_PACK``) or torch's bfloat16 matmul. Each is
forced here with its setting on the same tiny bfloat16 Llama and checked in the
engine process (the layers' state, the loaded build). ``SPYRE_CPU_ISA`` also
picks the build of the decode-attention kernel, checked likewise. The two GEMM
kernel builds run the same FMA chains and the two attention builds differ only
in float32 summation order, so their tokens are identical; every path is close
to float32 Hugging Face transformers (divergence only at a reference near-tie).
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("spyre_inference.testing")

from ops_engine_util import greedy

from spyre_inference.platform.native_build import AVX512_CPU_FLAGS, cpu_flags
from spyre_inference.testing import (
    TEST_PROMPTS,
    assert_greedy_close,
    hf_greedy_with_logprobs,
)


@pytest.fixture
def llm_in_process() -> bool:
    """Engines in their own process here: the GEMM path and the kernel builds are
    chosen once per process."""
    return False


MAX_TOKENS = 12
PROMPTS = TEST_PROMPTS[:4]

#: path -> (settings, expected layer state: "kernel-<isa>" | "copy" | "model")
PATHS = {
    "kernel-avx2": ({"SPYRE_CPU_GEMM_DTYPE": "float32", "SPYRE_CPU_ISA": "avx2"}, "kernel-avx2"),
    "kernel-avx512": (
        {"SPYRE_CPU_GEMM_DTYPE": "float32", "SPYRE_CPU_ISA": "avx512"},
        "kernel-avx512",
    ),
    "float32-copies": (
        {"SPYRE_CPU_GEMM_DTYPE": "float32", "SPYRE_CPU_GEMM_KERNEL": "torch"},
        "copy",
    ),
    # oneDNN throughout (by default the C++ op sends products of <= 2 rows to
    # the host kernel, SPYRE_CPU_GEMM_HOST_ROWS=auto).
    "onednn-packed": (
        {
            "SPYRE_CPU_GEMM_DTYPE": "model",
            "SPYRE_CPU_GEMM_PACK": "auto",
            "SPYRE_CPU_GEMM_HOST_ROWS": "0",
        },
        "packed",
    ),
    # The C++ op of the packed path sends products of <= 4 rows (decode steps of
    # up to 4 sequences) to the host kernel, the rest to oneDNN.
    "onednn-host-rows": (
        {
            "SPYRE_CPU_GEMM_DTYPE": "model",
            "SPYRE_CPU_GEMM_PACK": "auto",
            "SPYRE_CPU_GEMM_HOST_ROWS": "4",
        },
        "packed",
    ),
    "torch-model-dtype": ({"SPYRE_CPU_GEMM_DTYPE": "model", "SPYRE_CPU_GEMM_PACK": "off"}, "model"),
}


def _gemm_state(model) -> set[str]:
    """The GEMM path of every transposed-weight layer of the loaded model."""
    from spyre_inference.ops.host_gemm import kernel_isa
    from spyre_inference.ops.transposed_weight import (
        GEMM_WEIGHT_ATTR,
        HOST_KERNEL_ATTR,
        PACKED_ATTR,
        TRANSPOSED_FLAG,
    )

    states = set()
    for module in model.modules():
        if not getattr(module, TRANSPOSED_FLAG, False):
            continue
        if getattr(module, PACKED_ATTR, False):
            states.add("packed")
        elif getattr(module, HOST_KERNEL_ATTR, False):
            states.add(f"kernel-{kernel_isa()}")
        elif getattr(module, GEMM_WEIGHT_ATTR, None) is not None:
            states.add("copy")
        else:
            states.add("model")
    return states


def _attention_isa(model) -> str | None:
    """The decode-attention kernel build loaded in the engine (SPYRE_CPU_ISA picks it too)."""
    from spyre_inference.attention.ops import host_decode

    return host_decode.kernel_isa()


def _packed_op_routes(model) -> tuple[str, int]:
    """(the packed op's CPU kernel, rows it sends to the host kernel) in the engine."""
    from spyre_inference.ops import onednn_linear

    return onednn_linear.kernel(), onednn_linear.host_gemm_rows()


@pytest.fixture(scope="module")
def reference(tiny_model_factory):
    model = tiny_model_factory("llama")
    return model, hf_greedy_with_logprobs(model, PROMPTS, MAX_TOKENS, "float32", num_logprobs=5)


_tokens: dict[str, list[list[int]]] = {}


@pytest.mark.parametrize("path", list(PATHS))
def test_forced_gemm_path_serves_close_to_hf(path, reference, make_llm, monkeypatch):
    from spyre_inference.ops.host_gemm import kernel_unavailable_reason

    settings, expected = PATHS[path]
    if path == "kernel-avx512" and not set(AVX512_CPU_FLAGS) <= cpu_flags():
        pytest.skip("this CPU has no AVX-512 F/BW/VL/DQ")
    if path.startswith("kernel") and kernel_unavailable_reason(torch.bfloat16):
        pytest.skip("the host GEMM kernel cannot be built here")
    if path.startswith("onednn") and not torch.ops.mkldnn._is_mkldnn_bf16_supported():
        pytest.skip("oneDNN has no bfloat16 matmul on this CPU")
    if path == "onednn-host-rows" and kernel_unavailable_reason(torch.bfloat16):
        pytest.skip("the host GEMM kernel cannot be built here")
    for name, value in settings.items():
        monkeypatch.setenv(name, value)
    model, ref = reference
    llm = make_llm(model, dtype="bfloat16", enforce_eager=True)
    (state,) = llm.apply_model(_gemm_state)
    assert state == {expected}
    if path.startswith("kernel-"):
        # The forced ISA also selects the decode-attention kernel's build.
        (attention_isa,) = llm.apply_model(_attention_isa)
        assert attention_isa == settings["SPYRE_CPU_ISA"]
    if path.startswith("onednn"):
        (routes,) = llm.apply_model(_packed_op_routes)
        if routes[0] != "native":
            pytest.skip("the C++ linear op cannot be built here")
        assert routes == ("native", int(settings["SPYRE_CPU_GEMM_HOST_ROWS"]))
    got = greedy(llm, PROMPTS, MAX_TOKENS)
    assert_greedy_close(ref, got, max_logprob_gap=0.2, min_exact=2)
    _tokens[path] = got
    if path == "kernel-avx512" and "kernel-avx2" in _tokens:
        assert got == _tokens["kernel-avx2"], "the two kernel builds gave different tokens"
