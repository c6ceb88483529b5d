"""KernelFamily under the platform's settled guards (Dynamo's skip_guard_eval_unsafe stance).

A served step can run with only differentiating guards; an attention variant
compiled lazily inside such a step must still compile, and every variant must
keep returning its own shape's result.
"""

from __future__ import annotations

import torch

from spyre_inference.attention.ops.compiled import KernelFamily


def _scaled_sum(x: torch.Tensor, scale: float) -> torch.Tensor:
    return (x * scale).sum(dim=-1)


def test_variants_compile_and_stay_apart_under_skipped_guards() -> None:
    family = KernelFamily(_scaled_sum, name="scaled_sum")
    inputs = [(torch.randn(2, 8), 0.5), (torch.randn(3, 8), 0.5), (torch.randn(2, 8), 2.0)]
    with torch.compiler.set_stance("default", skip_guard_eval_unsafe=True):
        first = [family(True, *args) for args in inputs]  # each call compiles a variant
        again = [family(True, *args) for args in inputs]
    assert len(family) == 3
    for (x, scale), a, b in zip(inputs, first, again, strict=True):
        torch.testing.assert_close(a, _scaled_sum(x, scale))
        torch.testing.assert_close(b, _scaled_sum(x, scale))
