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

On the cpu target, when the host CPU has a fast GEMM for the model dtype, the
product runs through oneDNN on a copy of the ``[in, out]`` matrix prepacked at
load (:mod:`spyre_inference.ops.onednn_linear`, ``PACKED_ATTR``;
``SPYRE_CPU_GEMM_PACK``). When it has none
(:func:`spyre_inference.platform.device.host_gemm_dtype` says float32), the
matmul computes in float32 over the 16-bit ``[in, out]`` weight: through the
plugin's own kernel (:mod:`spyre_inference.ops.host_gemm`, ``HOST_KERNEL_ATTR``)
where it runs, else on a float32 copy of the same matrix (``GEMM_WEIGHT_ATTR``,
a plain attribute: not in the state dict) with torch's GEMM.

**Weight reload.** vLLM's layerwise reload (``reload_weights``, RL weight sync)
puts the checkpoint-layout ``weight`` back on the layer, loads into it, calls
``process_weights_after_loading`` again and copies the result into the tensors
the layer had. The method therefore decides what to do from the tensors, not
from a flag: it remembers (weakly) the matrix it made, and a call that finds
that very matrix is a refresh, any other a fresh transpose. Derived copies are
invisible to that reload and are refreshed by
:meth:`SpyreTransposedWeightMethod.refresh_after_weight_update` (the runner
calls it after every reload): a tied LM head's transposed matrix (the reload
writes the shared embedding weight only), the float32 copy and the oneDNN-packed
copy.
"""

from __future__ import annotations

import weakref

import torch
import torch.nn.functional as F
from torch.nn import Parameter
from vllm.model_executor.layers.linear import UnquantizedLinearMethod

from spyre_inference.ops import host_gemm, onednn_linear
from spyre_inference.ops.host_gemm import host_gemm_w16, kernel_unavailable_reason
from spyre_inference.ops.unused_stage import is_unused_stage
from spyre_inference.platform.device import host_gemm_dtype, round_up

#: Attribute recording that a layer's weight is stored transposed (read by
#: ``apply``; the post-load step decides by :data:`PROCESSED_ATTR`).
TRANSPOSED_FLAG = "_spyre_weight_transposed"
#: Weak reference to the ``[in, out]`` matrix the post-load step made.
PROCESSED_ATTR = "_spyre_processed_weight_t"
#: Weak reference to the loaded ``[out, in]`` weight: alive after load only
#: while another module holds it (a tied input embedding), whose reloads then
#: have to reach the transposed copy.
SOURCE_ATTR = "_spyre_weight_source"
#: The layer's true number of output features (before row padding).
OUT_FEATURES_ATTR = "_spyre_out_features"
#: cpu target without a fast model-dtype GEMM: the ``[in, out]`` matrix in the
#: dtype the host GEMM computes in.
GEMM_WEIGHT_ATTR = "_spyre_gemm_weight_t"
#: cpu target without a fast model-dtype GEMM: True when the float32 product
#: runs through the host kernel on the 16-bit matrix itself (no copy).
HOST_KERNEL_ATTR = "_spyre_host_kernel"
#: cpu target with a fast model-dtype GEMM: True when the product runs through
#: oneDNN on a prepacked copy of the matrix (:mod:`~spyre_inference.ops.onednn_linear`).
PACKED_ATTR = "_spyre_onednn_packed"


def spyre_linear_t(
    x: torch.Tensor,
    weight_t: torch.Tensor,
    bias: torch.Tensor | None = None,
    out_features: int | None = None,
    gemm_weight_t: torch.Tensor | None = None,
    keep_gemm_dtype: bool = False,
    host_kernel: bool = False,
    packed: bool = False,
) -> torch.Tensor:
    """``x @ weight_t (+ bias)`` with ``weight_t`` stored ``[in, out_padded]``.

    ``out_features`` below the stored width drops the trailing pad columns: an
    offset-0 slice, which Spyre copies without restickifying. ``gemm_weight_t``
    (cpu target, see the module docstring) is the same matrix in the host
    GEMM's dtype: the product is computed there and returned in ``x``'s dtype,
    or left in the GEMM's dtype with ``keep_gemm_dtype``. ``host_kernel``
    (cpu target) computes the same float32 product with the host kernel on
    ``weight_t`` itself; ``packed`` (cpu target) the model-dtype product through
    oneDNN on the matrix's prepacked copy.
    """
    if packed:
        out = onednn_linear.onednn_linear_t(x, weight_t)
    elif host_kernel:
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
        if is_unused_stage(layer):
            return
        current = getattr(layer, self.WEIGHT_T_ATTR, None)
        made = getattr(layer, PROCESSED_ATTR, None)
        if current is not None and made is not None and made() is current:
            # Called again on the matrix this method made (its values may have
            # been rewritten in place): only the derived copies change.
            self.refresh_after_weight_update(layer)
            return
        # A freshly loaded [out, in] weight: the first load, or vLLM's
        # layerwise reload, which restores the checkpoint layout first.
        weight = layer.weight
        if weight.dim() != 2:
            # Not a GEMM operand: Mamba2's conv1d is built as a linear layer
            # and reshaped to its [dim, 1, width] filter after construction
            # (vLLM's MambaMixer2), and only that filter is ever read.
            return
        out_features, _ = weight.shape
        weight_t = Parameter(self._transposed(weight.data), requires_grad=False)
        # Drop the loaded [out, in] parameter (its vLLM loader attributes
        # describe that layout). A tied embedding holds its own reference to
        # it, so only this module lets go of it.
        del layer.weight
        layer.register_parameter(self.WEIGHT_T_ATTR, weight_t)
        setattr(layer, OUT_FEATURES_ATTR, out_features)
        setattr(layer, TRANSPOSED_FLAG, True)
        setattr(layer, PROCESSED_ATTR, weakref.ref(weight_t))
        setattr(layer, SOURCE_ATTR, weakref.ref(weight))
        gemm_dtype = host_gemm_dtype(weight_t.dtype)
        setattr(layer, HOST_KERNEL_ATTR, False)
        setattr(layer, GEMM_WEIGHT_ATTR, None)
        setattr(layer, PACKED_ATTR, False)
        if gemm_dtype is None:
            if (
                weight_t.device.type == "cpu"
                and onednn_linear.unavailable_reason(weight_t.dtype) is None
            ):
                onednn_linear.pack(weight_t)
                setattr(layer, PACKED_ATTR, True)
            return
        if gemm_dtype == torch.float32 and kernel_unavailable_reason(weight_t.dtype) is None:
            host_gemm.dispatch()  # the op's C++ kernel needs the build's address
            setattr(layer, HOST_KERNEL_ATTR, True)
        else:
            # A plain attribute, not a buffer: not in the state dict, and not
            # a tensor vLLM's reload would restore from its old snapshot.
            setattr(layer, GEMM_WEIGHT_ATTR, weight_t.data.to(gemm_dtype))

    def _transposed(self, weight: torch.Tensor) -> torch.Tensor:
        """``[out, in]`` -> contiguous ``[in, out_padded]`` (zero pad rows)."""
        out_features = weight.shape[0]
        padded = round_up(out_features, self.ROW_ALIGN)
        if padded != out_features:
            # Zero rows: the extra logits/outputs are sliced off in apply.
            weight = F.pad(weight, (0, 0, 0, padded - out_features))
        return weight.t().contiguous()

    @torch.no_grad()
    def refresh_after_weight_update(self, layer: torch.nn.Module) -> None:
        """Bring the copies derived from the weight up to date, in place.

        After a reload the transposed matrix of a tied head is stale (the
        reload wrote the shared embedding weight) and so is the float32 copy
        of any layer. Safe to call on a layer whose weights did not change.
        """
        if not getattr(layer, TRANSPOSED_FLAG, False):
            return
        weight_t = getattr(layer, self.WEIGHT_T_ATTR)
        # vLLM's reload copies the new matrix into the layer's old one and puts
        # that back: it is the one this method now stands behind.
        setattr(layer, PROCESSED_ATTR, weakref.ref(weight_t))
        source_ref = getattr(layer, SOURCE_ATTR, None)
        source = source_ref() if source_ref is not None else None
        if source is not None:
            weight_t.data.copy_(self._transposed(source.data.to(weight_t.device)))
        gemm = getattr(layer, GEMM_WEIGHT_ATTR, None)
        if gemm is not None:
            gemm.copy_(weight_t.data)
        if getattr(layer, PACKED_ATTR, False):
            onednn_linear.pack(weight_t)

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
            getattr(layer, PACKED_ATTR, False),
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
