"""Weights transposed once at load: ``x @ Wt`` instead of ``F.linear(x, W)``.

``F.linear(x, W)`` computes ``x @ W.T`` whatever W's layout, and on Spyre that
transposed matmul is about 3.5x slower than a plain ``x @ A`` (torch-spyre#3512).
:class:`SpyreTransposedWeightMethod` pays the transpose once, in
``process_weights_after_loading`` (the weights are still on the host then),
storing a contiguous ``[in, out]`` matrix, and ``apply`` runs a plain matmul.
It is the pure-PyTorch equivalent of torch-spyre's ``[1, 0]`` weight layout,
which only fires for ``nn.Linear`` and so misses every vLLM parallel linear.

Subclasses choose where the transposed matrix lives (``WEIGHT_T_ATTR``) and
whether its output columns are padded to a row multiple first (``ROW_ALIGN``);
``apply`` then drops the pad columns with a slice. The linear layers use the
defaults (in place, no padding); the LM head pads the vocabulary to 64x32.

On the cpu target, when the host CPU has no fast GEMM for the model dtype
(:func:`spyre_inference.platform.device.host_gemm_dtype` says float32), the
matmul computes in float32 over the 16-bit ``[in, out]`` weight: through the
plugin's own kernel (:mod:`spyre_inference.ops.host_gemm`, ``HOST_KERNEL_ATTR``)
where it runs, else on a float32 copy of the same matrix (``GEMM_WEIGHT_ATTR``,
a non-persistent buffer: not in the state dict) with torch's GEMM.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.nn import Parameter
from vllm.model_executor.layers.linear import UnquantizedLinearMethod

from spyre_inference.ops.host_gemm import host_gemm_w16, kernel_unavailable_reason
from spyre_inference.platform.device import host_gemm_dtype, round_up

#: Attribute recording that a layer's weight is already stored transposed, so a
#: second ``process_weights_after_loading`` (weight reload) does not transpose
#: it back.
TRANSPOSED_FLAG = "_spyre_weight_transposed"
#: The layer's true number of output features (before row padding).
OUT_FEATURES_ATTR = "_spyre_out_features"
#: cpu target without a fast model-dtype GEMM: the ``[in, out]`` matrix in the
#: dtype the host GEMM computes in.
GEMM_WEIGHT_ATTR = "_spyre_gemm_weight_t"
#: cpu target without a fast model-dtype GEMM: True when the float32 product
#: runs through the host kernel on the 16-bit matrix itself (no copy).
HOST_KERNEL_ATTR = "_spyre_host_kernel"


def spyre_linear_t(
    x: torch.Tensor,
    weight_t: torch.Tensor,
    bias: torch.Tensor | None = None,
    out_features: int | None = None,
    gemm_weight_t: torch.Tensor | None = None,
    keep_gemm_dtype: bool = False,
    host_kernel: bool = False,
) -> torch.Tensor:
    """``x @ weight_t (+ bias)`` with ``weight_t`` stored ``[in, out_padded]``.

    ``out_features`` below the stored width drops the trailing pad columns: an
    offset-0 slice, which Spyre copies without restickifying. ``gemm_weight_t``
    (cpu target, see the module docstring) is the same matrix in the host
    GEMM's dtype: the product is computed there and returned in ``x``'s dtype,
    or left in the GEMM's dtype with ``keep_gemm_dtype``. ``host_kernel``
    (cpu target) computes the same float32 product with the host kernel on
    ``weight_t`` itself.
    """
    if host_kernel:
        # The widening cast is outside the op so Inductor fuses it into the
        # kernel that produces x (norm, activation).
        out = host_gemm_w16(x.to(torch.float32), weight_t)
        if not keep_gemm_dtype:
            out = out.to(x.dtype)
    elif gemm_weight_t is not None:
        out = torch.matmul(x.to(gemm_weight_t.dtype), gemm_weight_t)
        if not keep_gemm_dtype:
            out = out.to(x.dtype)
    else:
        out = torch.matmul(x, weight_t)
    if out_features is not None and out_features != out.shape[-1]:
        out = out[..., :out_features]
    if bias is not None:
        out = out + bias
    return out


class SpyreTransposedWeightMethod:
    """Shared base of the transposed-weight fast path (mixed into a vLLM method).

    Class attributes:

    * ``WEIGHT_T_ATTR``: where the ``[in, out]`` matrix is stored. ``"weight"``
      replaces the loaded weight in place; any other name registers a new
      parameter and drops the module's ``weight`` (a tied embedding keeps its
      own reference to the original).
    * ``ROW_ALIGN``: output rows are zero-padded to a multiple of this before
      transposing (1: no padding).
    """

    WEIGHT_T_ATTR: str = "weight"
    ROW_ALIGN: int = 1
    #: Return the product in the host GEMM's dtype rather than the input's
    #: (only where a float32 copy exists, i.e. on the cpu target).
    KEEP_GEMM_DTYPE: bool = False

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        if getattr(layer, TRANSPOSED_FLAG, False):
            # A weight reload wrote new values into the transposed matrix.
            gemm = getattr(layer, GEMM_WEIGHT_ATTR, None)
            if gemm is not None:
                gemm.copy_(getattr(layer, self.WEIGHT_T_ATTR))
            return
        weight = layer.weight
        out_features, _ = weight.shape
        padded = round_up(out_features, self.ROW_ALIGN)
        data = weight.data
        if padded != out_features:
            # Zero rows: the extra logits/outputs are sliced off in apply.
            data = F.pad(data, (0, 0, 0, padded - out_features))
        weight_t = Parameter(data.t().contiguous(), requires_grad=False)
        # Drop the loaded [out, in] parameter (its vLLM loader attributes
        # describe that layout). A tied embedding holds its own reference to
        # it, so only this module lets go of it.
        del layer.weight
        layer.register_parameter(self.WEIGHT_T_ATTR, weight_t)
        setattr(layer, OUT_FEATURES_ATTR, out_features)
        setattr(layer, TRANSPOSED_FLAG, True)
        gemm_dtype = host_gemm_dtype(weight_t.dtype)
        if gemm_dtype is None:
            return
        if gemm_dtype == torch.float32 and kernel_unavailable_reason(weight_t.dtype) is None:
            setattr(layer, HOST_KERNEL_ATTR, True)
        else:
            layer.register_buffer(GEMM_WEIGHT_ATTR, weight_t.data.to(gemm_dtype), persistent=False)

    def apply(
        self,
        layer: torch.nn.Module,
        x: torch.Tensor,
        bias: torch.Tensor | None = None,
    ) -> torch.Tensor:
        if not getattr(layer, TRANSPOSED_FLAG, False):
            # Before process_weights_after_loading (e.g. a profile run on an
            # unprocessed layer): the weight is still [out, in].
            return F.linear(x, layer.weight, bias)
        weight_t = getattr(layer, self.WEIGHT_T_ATTR)
        return spyre_linear_t(
            x,
            weight_t,
            bias,
            getattr(layer, OUT_FEATURES_ATTR),
            getattr(layer, GEMM_WEIGHT_ATTR, None),
            self.KEEP_GEMM_DTYPE,
            getattr(layer, HOST_KERNEL_ATTR, False),
        )


class SpyreUnquantizedLinearMethod(SpyreTransposedWeightMethod, UnquantizedLinearMethod):
    """Unquantized linear with the weight stored transposed in place.

    Subclasses vLLM's ``UnquantizedLinearMethod`` so weight creation and every
    ``isinstance(..., UnquantizedLinearMethod)`` check in vLLM stay as they are.
    """


def install_transposed_method(layer: torch.nn.Module) -> bool:
    """Give ``layer`` the transposed fast path if its method is plain unquantized.

    Only the exact ``UnquantizedLinearMethod`` is replaced: quantized methods
    keep their own kernels (and the slower ``F.linear`` path they imply), and
    vLLM's own specialisations of the unquantized method (for example the MoE
    gate's ROCm split) carry state this swap would drop. Safe after
    ``create_weights``: the unquantized method keeps no per-layer state and the
    Spyre method creates the very same weight.
    """
    if type(layer.quant_method) is UnquantizedLinearMethod:
        layer.quant_method = SpyreUnquantizedLinearMethod()
        return True
    return False


__all__ = [
    "SpyreTransposedWeightMethod",
    "SpyreUnquantizedLinearMethod",
    "install_transposed_method",
    "spyre_linear_t",
]
