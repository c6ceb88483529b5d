"""Per-block compilation (spec, "Compilation Granularity").

Under ``CompilationMode.STOCK_TORCH_COMPILE`` each entry of the model's block
``ModuleList`` is compiled in place with ``block.compile(...)``. In place
matters: rebinding the list entry to the ``OptimizedModule`` that
``torch.compile`` returns would re-parent the block under ``_orig_mod`` and
rename every parameter, breaking weight save/reload.

Blocks of one class share one ``forward`` code object, so Dynamo traces the
first block and the others pass its guards: the number of compiled graphs is
independent of depth. It is not one per class: a Llama stack needs two graphs
per num_tokens bucket (layer 0 specializes on ``residual is None``), a Gemma 3
stack that alternates sliding-window and full attention more. This holds only
while the per-layer attention name is a graph *input* (vLLM's ``LayerName``
opaque type, torch >= 2.11 with ``VLLM_USE_LAYERNAME=1``); when the name is a
baked-in constant every layer compiles its own graph, which is worse than one
whole-model graph. :func:`compile_model` warns about that up front and
:func:`baked_layer_names` confirms it from Dynamo's guards after warm-up.

Every graph is ``dynamic=False`` (torch-spyre's Inductor backend rejects
SymInt shapes); the runner pads num_tokens onto
:mod:`~spyre_inference.platform.token_buckets` and warms every bucket up.
Compiled artifacts land in Inductor's on-disk caches (FX graph cache and
AOTAutograd cache) under a stable per-user directory
(:func:`configure_inductor_cache`), so a second start of the same model skips
Inductor's code generation and C++ builds.
"""

from __future__ import annotations

import dataclasses
import inspect
import os
import re
import types
from collections import Counter
from collections.abc import Iterable
from pathlib import Path

import torch
from torch import nn

from spyre_inference.platform import device as dev
from spyre_inference.platform import direct_block_calls, settings
from spyre_inference.platform.cache_dir import cache_root
from spyre_inference.platform.logs import get_logger

logger = get_logger(__name__)


def compile_kwargs() -> dict[str, object]:
    """What every ``torch.compile`` of the plugin gets.

    The target's Inductor backend (:func:`~spyre_inference.platform.device.compile_backend`),
    whole graphs only (a graph break would hand an eager fragment to a device
    that cannot run it), static shapes.
    """
    return {"backend": dev.compile_backend(), "fullgraph": True, "dynamic": False}


#: Dynamo guard on a per-layer attention name compiled in as a constant, e.g.
#: ``L['self']._modules['self_attn']._modules['attn'].layer_name
#: == 'model.layers.3.self_attn.attn'``.
_BAKED_NAME_GUARD = re.compile(r"\blayer_name == '")


# ---- finding the blocks ----------------------------------------------------


def _is_attention(module: nn.Module) -> bool:
    from vllm.model_executor.layers.attention import Attention

    return isinstance(module, Attention)


def _owns_attention(module: nn.Module) -> bool:
    return any(_is_attention(m) for m in module.modules())


def find_block_lists(model: nn.Module) -> list[tuple[str, nn.ModuleList]]:
    """The model's block stacks: ModuleLists of non-Attention entries that own an Attention.

    Found structurally, not by attribute name, so decoder stacks
    (``model.layers``), encoder stacks (``bert.encoder.layer``) and hybrid
    stacks are all covered. ``PPMissingLayer`` placeholders (layers owned by
    another pipeline rank) are ignored. In a hybrid stack (e.g. Mamba layers
    mixed with attention layers in one list) it is enough that *some* entry
    owns an Attention: the list is still the model's stack of blocks, and
    every entry of it is compiled. A list whose entries are themselves
    Attention layers (Zamba2's shared ``dpa_list``) is not a block stack.
    Models whose attention is not a vLLM ``Attention`` (MLA, vision towers)
    match nothing. A stack nested inside an outer stack's block belongs to
    that block's graph and is not reported separately.
    """
    from vllm.model_executor.models.utils import PPMissingLayer

    found: list[tuple[str, nn.ModuleList]] = []
    for name, module in model.named_modules():
        if not isinstance(module, nn.ModuleList):
            continue
        entries = [m for m in module if not isinstance(m, PPMissingLayer)]
        if not entries or any(_is_attention(m) for m in entries):
            continue
        if any(_owns_attention(m) for m in entries):
            found.append((name, module))
    outer = [n for n, _ in found]
    return [(n, m) for n, m in found if not any(o != n and n.startswith(o + ".") for o in outer)]


# ---- Inductor's on-disk caches ---------------------------------------------


def default_inductor_cache_dir() -> Path:
    """``$XDG_CACHE_HOME/spyre-inference/inductor`` (``~/.cache`` when unset).

    Stable across reboots, unlike torch's default under the temp directory,
    and per user like every other cache in ``~/.cache``.
    """
    return cache_root() / "inductor"


def configure_inductor_cache() -> str:
    """Point Inductor's on-disk caches at a stable directory; returns the directory used.

    ``TORCHINDUCTOR_CACHE_DIR`` set by the user wins. torch itself writes its
    ``/tmp/torchinductor_<user>`` default into that variable the first time
    anything asks for the cache directory, so a value equal to torch's default
    counts as unset. The FX graph cache and the AOTAutograd cache are on by
    default in torch; they stay under the user's control through torch's own
    variables (``TORCHINDUCTOR_FX_GRAPH_CACHE=0``,
    ``TORCHINDUCTOR_AUTOGRAD_CACHE=0``, ``TORCHINDUCTOR_FORCE_DISABLE_CACHES=1``).
    Under ``STOCK_TORCH_COMPILE`` vLLM's own compile cache (``VLLM_CACHE_ROOT``)
    is not involved: its backend and AOT compile are never used here. vLLM's
    switch for it, ``VLLM_DISABLE_COMPILE_CACHE=1``, is honoured by turning
    Inductor's caches off, since those are the only compile caches here.
    """
    import vllm.envs as vllm_envs
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    if vllm_envs.VLLM_DISABLE_COMPILE_CACHE:
        torch._inductor.config.force_disable_caches = True

    current = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    if current is None or os.path.abspath(current) == os.path.abspath(default_cache_dir()):
        target = default_inductor_cache_dir()
        try:
            target.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            logger.warning(
                "Cannot create the compile cache %s (%s); using torch's default %s.",
                target,
                exc,
                default_cache_dir(),
            )
        else:
            os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(target)
            # Forget cache paths memoised under the old directory.
            from torch._inductor.utils import clear_caches

            clear_caches()
    cache_dir = os.environ.get("TORCHINDUCTOR_CACHE_DIR") or default_cache_dir()
    inductor_cfg = torch._inductor.config
    enabled = (
        inductor_cfg.fx_graph_cache
        and torch._functorch.config.enable_autograd_cache
        and not inductor_cfg.force_disable_caches
    )
    if enabled:
        logger.info("Inductor compile cache: %s", cache_dir)
    else:
        logger.warning(
            "Inductor's FX graph / AOTAutograd cache is disabled: every start recompiles "
            "every graph (cache directory would be %s).",
            cache_dir,
        )
    return cache_dir


# ---- compiling -------------------------------------------------------------


@dataclasses.dataclass
class CompileReport:
    """What :func:`compile_model` compiled, for warm-up logging, checks and tests."""

    #: ``"block"`` (each block in place) or ``"model"`` (one whole-model graph).
    granularity: str
    #: Dotted names of the compiled block lists (empty for ``"model"``).
    stacks: tuple[str, ...]
    #: Number of blocks compiled per block class (``{model class: 1}`` for
    #: ``"model"``); keys are class names.
    classes: dict[str, int]
    #: The ``forward`` code objects Dynamo holds compiled graphs for, by class.
    codes: dict[str, tuple[types.CodeType, ...]]
    cache_dir: str

    def artifacts(self) -> dict[str, int]:
        """Compiled graphs held per compiled class (one per variant and bucket)."""
        return {
            name: sum(len(direct_block_calls.cache_entries(c)) for c in codes)
            for name, codes in self.codes.items()
        }

    def total_artifacts(self) -> int:
        return sum(self.artifacts().values())


def _forward_codes(module_cls: type) -> tuple[types.CodeType, ...]:
    """Code objects Dynamo may attach a compiled ``forward`` to.

    ``module.compile()`` compiles ``nn.Module._call_impl``; Dynamo skips that
    torch-internal frame and compiles the first user frame, the class's
    ``forward`` (or the decorator wrapping it, hence both).
    """
    forward = module_cls.forward
    codes = []
    for fn in (forward, inspect.unwrap(forward)):
        code = getattr(fn, "__code__", None)
        if code is not None and code not in codes:
            codes.append(code)
    return tuple(codes)


def _layer_name_is_hoisted() -> bool:
    """Whether vLLM passes attention layer names into graphs as opaque inputs."""
    try:
        from vllm.utils.torch_utils import _USE_LAYERNAME
    except ImportError:  # older vLLM: names are plain strings
        return False
    return bool(_USE_LAYERNAME)


def compile_model(model: nn.Module, num_shapes: int = 1) -> CompileReport:
    """Compile ``model`` in place at the configured granularity.

    ``num_shapes`` is the number of num_tokens buckets warm-up will run: Dynamo
    keeps one cache entry per (block variant, bucket) on the shared ``forward``
    code object, and must be allowed that many before it gives up.
    """
    from vllm.model_executor.models.utils import PPMissingLayer

    cache_dir = configure_inductor_cache()
    granularity = settings.get("SPYRE_COMPILE_GRANULARITY")
    stacks = find_block_lists(model) if granularity == "block" else []
    if granularity == "block" and not stacks:
        logger.info(
            "%s has no block stack with a vLLM Attention (e.g. MLA or a vision tower); "
            "compiling the whole model as one graph.",
            type(model).__name__,
        )

    if torch._inductor.config.freezing:
        # Freezing folds each block's weights into its own graph as constants:
        # blocks stop sharing graphs (spec: "defeats sharing the same way").
        logger.warning(
            "Inductor freezing is on (TORCHINDUCTOR_FREEZING=1 or max_autotune): weights "
            "become graph constants, so every block compiles its own graph."
        )

    if not stacks:
        model.compile(**compile_kwargs())
        name = type(model).__name__
        # One graph per bucket (a few spare for a model with its own branches).
        raise_recompile_limit(num_shapes * 4)
        logger.info(
            "Compiling %s as one whole-model graph (%s).",
            name,
            "SPYRE_COMPILE_GRANULARITY=model" if granularity == "model" else "no block stack",
        )
        return CompileReport("model", (), {name: 1}, {name: _forward_codes(type(model))}, cache_dir)

    classes: Counter[str] = Counter()
    codes: dict[str, tuple[types.CodeType, ...]] = {}
    direct = settings.get("SPYRE_SETTLED_GUARDS") and settings.get("SPYRE_DIRECT_BLOCK_CALLS")
    for _, stack in stacks:
        for block in stack:
            if isinstance(block, PPMissingLayer):
                continue
            # In place: the list entry stays the same module object.
            block.compile(**compile_kwargs())
            if direct:
                direct_block_calls.install(block)
            cls = type(block)
            classes[cls.__name__] += 1
            codes.setdefault(cls.__name__, _forward_codes(cls))

    hoisted = _layer_name_is_hoisted()
    if not hoisted:
        logger.warning(
            "Attention layer names are compiled into the block graphs as constants "
            "(needs torch >= 2.11 and VLLM_USE_LAYERNAME=1 to pass them as inputs): every "
            "block compiles its own graph, %d per num_tokens bucket instead of a few. "
            "Set VLLM_USE_LAYERNAME=1, or SPYRE_COMPILE_GRANULARITY=model.",
            sum(classes.values()),
        )
    # Variants per class are few when names are hoisted (2 for Llama, 3 for
    # Gemma 3 with scaled global RoPE); when they are not, every block is one. Never let Dynamo
    # fall back to eager for a block mid-warm-up.
    per_shape = 8 if hoisted else max(8, max(classes.values()) + 2)
    raise_recompile_limit(num_shapes * per_shape)
    logger.info(
        "Compiling %d blocks in place (%s): %s",
        sum(classes.values()),
        ", ".join(n for n, _ in stacks),
        ", ".join(f"{n} x{c}" for n, c in classes.items()),
    )
    return CompileReport("block", tuple(n for n, _ in stacks), dict(classes), codes, cache_dir)


def baked_layer_names(report: CompileReport) -> dict[str, int]:
    """Per compiled class, how many of its graphs guard on a constant layer name.

    A guard like ``...attn.layer_name == 'model.layers.3.self_attn.attn'`` means
    Dynamo specialized that graph to one layer: depth independence is lost.
    Reads Dynamo's guard text, a debugging interface; on a torch where it is
    unavailable nothing is reported.
    """
    baked: dict[str, int] = {}
    for name, codes in report.codes.items():
        n = 0
        for code in codes:
            for entry in direct_block_calls.cache_entries(code):
                parts: Iterable[str] = getattr(entry.guard_manager, "code_parts", ()) or ()
                if any(_BAKED_NAME_GUARD.search(p) for p in parts):
                    n += 1
        if n:
            baked[name] = n
    return baked


def check_depth_independence(report: CompileReport) -> bool:
    """Warn (and return False) when compiled blocks specialized on their layer names."""
    if report.granularity != "block":
        return True
    baked = baked_layer_names(report)
    if not baked:
        return True
    logger.warning(
        "Per-layer attention names are baked into the block graphs (%s): each block "
        "compiled separately, so compile time grows with depth. Use torch >= 2.11 with "
        "VLLM_USE_LAYERNAME=1, or SPYRE_COMPILE_GRANULARITY=model.",
        ", ".join(f"{n}: {c} graphs" for n, c in baked.items()),
    )
    return False


def raise_recompile_limit(min_limit: int) -> None:
    """Let Dynamo keep ``min_limit`` compiled graphs per code object.

    Dynamo's default (8) counts entries per code object, and all blocks of a
    class share one: (variants x buckets) entries. Past the limit Dynamo would
    run the block eagerly, silently.
    """
    cfg = torch._dynamo.config
    if cfg.recompile_limit < min_limit:
        cfg.recompile_limit = min_limit
    if cfg.accumulated_recompile_limit < 4 * min_limit:
        cfg.accumulated_recompile_limit = 4 * min_limit
