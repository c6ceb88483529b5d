"""8-bit checkpoints in the compressed-tensors layout, made offline from a tiny model.

:func:`quantize_checkpoint` writes what ``llmcompressor`` would for the
schemes the plugin serves, without it (it is not installed offline): each
decoder linear weight (``*_proj.weight``) quantized symmetrically per output
channel, its ``weight_scale`` (``[out, 1]`` float32) beside it, and the
``quantization_config`` vLLM's ``CompressedTensorsConfig`` parses. The LM head
and embeddings stay 16-bit (``ignore: ["lm_head"]``), as in published
checkpoints.

:func:`dequantized_checkpoint` writes the same model with each quantized
weight replaced by ``q * scale``: the reference transformers runs, so that a
comparison measures the kernels, not the rounding of the weights.

Schemes (compressed-tensors names):

* ``fp8_w8a8``: FP8 e4m3 weights, dynamic per-token FP8 activations;
* ``fp8_w8a16``: FP8 e4m3 weights, activations in the model dtype;
* ``int8_w8a8``: INT8 weights, dynamic per-token symmetric INT8 activations.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import torch

SCHEMES = ("fp8_w8a8", "fp8_w8a16", "int8_w8a8")

_FP8_MAX = float(torch.finfo(torch.float8_e4m3fn).max)


def _is_quantized(name: str, tensor: torch.Tensor) -> bool:
    return tensor.ndim == 2 and name.endswith("_proj.weight") and ".layers." in name


def quantize_weight(weight: torch.Tensor, scheme: str) -> tuple[torch.Tensor, torch.Tensor]:
    """``(q [out, in], scale [out, 1] float32)``: symmetric, per output channel."""
    w = weight.float()
    amax = w.abs().amax(dim=1, keepdim=True).clamp_min(1e-12)
    if scheme.startswith("fp8"):
        scale = amax / _FP8_MAX
        return (w / scale).clamp(-_FP8_MAX, _FP8_MAX).to(torch.float8_e4m3fn), scale
    scale = amax / 127.0
    return (w / scale).round().clamp(-128, 127).to(torch.int8), scale


def _args(kind: str, strategy: str, dynamic: bool) -> dict[str, Any]:
    return {
        "num_bits": 8,
        "type": kind,
        "symmetric": True,
        "strategy": strategy,
        "dynamic": dynamic,
        "group_size": None,
        "block_structure": None,
        "observer": None if dynamic else "minmax",
        "actorder": None,
        "observer_kwargs": {},
    }


def quantization_config(scheme: str) -> dict[str, Any]:
    """The ``quantization_config`` of :func:`quantize_checkpoint`'s output."""
    if scheme not in SCHEMES:
        raise ValueError(f"unknown scheme {scheme!r}; choose from {SCHEMES}")
    kind = "float" if scheme.startswith("fp8") else "int"
    acts = None if scheme == "fp8_w8a16" else _args(kind, "token", dynamic=True)
    return {
        "quant_method": "compressed-tensors",
        "format": "float-quantized" if kind == "float" else "int-quantized",
        "quantization_status": "compressed",
        "config_groups": {
            "group_0": {
                "targets": ["Linear"],
                "weights": _args(kind, "channel", dynamic=False),
                "input_activations": acts,
                "output_activations": None,
            }
        },
        "ignore": ["lm_head"],
        "kv_cache_scheme": None,
    }


def _rewrite(src: Path, out: Path, tensors: dict[str, torch.Tensor], config: dict) -> Path:
    from safetensors.torch import save_file

    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    for item in src.iterdir():
        if item.name not in ("model.safetensors", "config.json"):
            shutil.copy2(item, out / item.name)
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(config, indent=2))
    return out


def quantize_checkpoint(
    src: str | os.PathLike[str], out: str | os.PathLike[str], scheme: str
) -> Path:
    """``src`` (a 16/32-bit model folder) quantized with ``scheme`` into ``out``."""
    from safetensors.torch import load_file

    src, out = Path(src), Path(out)
    tensors = load_file(src / "model.safetensors")
    result: dict[str, torch.Tensor] = {}
    for name, tensor in tensors.items():
        if _is_quantized(name, tensor):
            q, scale = quantize_weight(tensor, scheme)
            result[name] = q.contiguous()
            result[name.removesuffix("weight") + "weight_scale"] = scale.contiguous()
        else:
            result[name] = tensor
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = quantization_config(scheme)
    return _rewrite(src, out, result, config)


def dequantized_checkpoint(
    quantized: str | os.PathLike[str], out: str | os.PathLike[str], dtype: torch.dtype
) -> Path:
    """The model of a :func:`quantize_checkpoint` folder with ``q * scale`` weights in
    ``dtype`` and no ``quantization_config``: the reference on the same weights."""
    from safetensors.torch import load_file

    quantized, out = Path(quantized), Path(out)
    tensors = load_file(quantized / "model.safetensors")
    result: dict[str, torch.Tensor] = {}
    for name, tensor in tensors.items():
        if name.endswith("weight_scale"):
            continue
        scale = tensors.get(name.removesuffix("weight") + "weight_scale")
        if scale is not None:
            result[name] = (tensor.float() * scale).to(dtype)
        else:
            result[name] = tensor.to(dtype) if tensor.is_floating_point() else tensor
    config = json.loads((quantized / "config.json").read_text())
    config.pop("quantization_config", None)
    config["dtype"] = str(dtype).removeprefix("torch.")
    return _rewrite(quantized, out, result, config)


#: The vocabulary matrices of the tiny decoders (the head only when untied).
VOCAB_TENSORS = ("model.embed_tokens.weight", "lm_head.weight")


def int8_vocab_reference(
    src: str | os.PathLike[str], out: str | os.PathLike[str], dtype: torch.dtype
) -> Path:
    """``src`` with its vocabulary matrices replaced by their INT8 round trip
    (symmetric, a scale per vocabulary row) in ``dtype``: what transformers runs as
    the reference for ``SPYRE_CPU_INT8_VOCAB=1``."""
    from safetensors.torch import load_file

    src, out = Path(src), Path(out)
    tensors = load_file(src / "model.safetensors")
    result: dict[str, torch.Tensor] = {}
    for name, tensor in tensors.items():
        if name in VOCAB_TENSORS:
            q, scale = quantize_weight(tensor, "int8_w8a8")
            result[name] = (q.float() * scale).to(dtype)
        else:
            result[name] = tensor.to(dtype) if tensor.is_floating_point() else tensor
    config = json.loads((src / "config.json").read_text())
    config["dtype"] = str(dtype).removeprefix("torch.")
    return _rewrite(src, out, result, config)


__all__ = [
    "SCHEMES",
    "VOCAB_TENSORS",
    "dequantized_checkpoint",
    "int8_vocab_reference",
    "quantization_config",
    "quantize_checkpoint",
    "quantize_weight",
]
