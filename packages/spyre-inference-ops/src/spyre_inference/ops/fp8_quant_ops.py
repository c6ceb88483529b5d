"""PyTorch bodies for vLLM's three FP8 quantization ops, where vLLM was built without them.

vLLM's FP8 code quantizes tensors through compiled ops in its ``_C`` library
(``vllm._custom_ops.scaled_fp8_quant`` calls ``torch.ops._C.static_scaled_fp8_quant``,
``dynamic_scaled_fp8_quant`` or ``dynamic_per_token_scaled_fp8_quant``): online
``quantization="fp8"`` quantizes every weight that way when it loads. A vLLM
built for an out-of-tree device (``VLLM_TARGET_DEVICE=empty``, as here) ships
no ``_C`` library, and the first call fails with "'_C' object has no attribute
'static_scaled_fp8_quant'". :func:`register_missing` defines exactly those
three ops, with vLLM's own schemas (``csrc/torch_bindings.cpp``), as plain
PyTorch for every device, and only when vLLM has not registered them: a build
with its compiled kernels keeps them. The arithmetic is the reference recipe of
vLLM's tests (``tests/kernels/quant_utils.py``): scale = amax / 448, with a
floor of 1 / (448 * 512) on dynamic scales, then divide and clamp.
"""

from __future__ import annotations

import torch

_FP8_MAX = float(torch.finfo(torch.float8_e4m3fn).max)
_MIN_SCALE = 1.0 / (_FP8_MAX * 512.0)

#: name -> (schema from vLLM's csrc/torch_bindings.cpp, body)
_SCHEMAS = {
    "static_scaled_fp8_quant": (
        "static_scaled_fp8_quant(Tensor! result, Tensor input, Tensor scale, "
        "int[]? group_shape=None) -> ()"
    ),
    "dynamic_scaled_fp8_quant": (
        "dynamic_scaled_fp8_quant(Tensor! result, Tensor input, Tensor! scale) -> ()"
    ),
    "dynamic_per_token_scaled_fp8_quant": (
        "dynamic_per_token_scaled_fp8_quant(Tensor! result, Tensor input, Tensor! scale, "
        "Tensor? scale_ub) -> ()"
    ),
}

_library: torch.library.Library | None = None


def _write(result: torch.Tensor, x: torch.Tensor, scale: torch.Tensor) -> None:
    q = (x.float() / scale).clamp(-_FP8_MAX, _FP8_MAX)
    result[: x.shape[0]].copy_(q.to(result.dtype))


def static_scaled_fp8_quant(
    result: torch.Tensor,
    input: torch.Tensor,  # vLLM's argument name (the op's schema)
    scale: torch.Tensor,
    group_shape: list[int] | None = None,
) -> None:
    s = scale.float()
    if s.numel() > 1 and s.ndim == 1:
        # A 1-D scale per row or per column, as the group shape says.
        s = s.reshape(-1, 1) if group_shape and group_shape[1] == -1 else s.reshape(1, -1)
    _write(result, input, s)


def dynamic_scaled_fp8_quant(
    result: torch.Tensor,
    input: torch.Tensor,
    scale: torch.Tensor,
) -> None:
    amax = input.float().abs().amax()
    scale.copy_((amax / _FP8_MAX).clamp_min(_MIN_SCALE).reshape(scale.shape))
    _write(result, input, scale.reshape(()))


def dynamic_per_token_scaled_fp8_quant(
    result: torch.Tensor,
    input: torch.Tensor,
    scale: torch.Tensor,
    scale_ub: torch.Tensor | None,
) -> None:
    amax = input.float().abs().amax(dim=-1, keepdim=True)
    if scale_ub is not None:
        amax = amax.clamp(max=scale_ub.float())
    scale.copy_((amax / _FP8_MAX).clamp_min(_MIN_SCALE).reshape(scale.shape))
    _write(result, input, scale.reshape(-1, 1))


_BODIES = {
    "static_scaled_fp8_quant": static_scaled_fp8_quant,
    "dynamic_scaled_fp8_quant": dynamic_scaled_fp8_quant,
    "dynamic_per_token_scaled_fp8_quant": dynamic_per_token_scaled_fp8_quant,
}


def missing() -> list[str]:
    """The three ops vLLM's ``_C`` library does not provide in this process."""
    return [name for name in _SCHEMAS if not hasattr(torch.ops._C, name)]


def register_missing() -> list[str]:
    """Define the missing ops (idempotent); returns the names defined now."""
    global _library
    names = missing()
    if not names:
        return []
    if _library is None:
        _library = torch.library.Library("_C", "FRAGMENT")
    for name in names:
        _library.define(_SCHEMAS[name])
        _library.impl(name, _BODIES[name], "CompositeExplicitAutograd")
    return names


__all__ = [
    "dynamic_per_token_scaled_fp8_quant",
    "dynamic_scaled_fp8_quant",
    "missing",
    "register_missing",
    "static_scaled_fp8_quant",
]
