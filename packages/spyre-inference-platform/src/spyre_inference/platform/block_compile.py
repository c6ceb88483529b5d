"""Per-block compilation (spec, "Compilation Granularity").

Each entry of the model's block ``ModuleList`` is compiled in place with
``block.compile(...)``. In place matters: rebinding the list entry to the
``OptimizedModule`` that ``torch.compile`` returns would re-parent the block
under ``_orig_mod`` and rename every parameter, breaking weight save/reload.
Blocks of one class share a forward code object, so Dynamo traces the first
and the others hit its cache: compile cost is independent of depth.
"""

from __future__ import annotations

import torch
from torch import nn

from spyre_inference.platform import settings
from spyre_inference.platform.logs import get_logger

logger = get_logger(__name__)


def _is_attention(module: nn.Module) -> bool:
    from vllm.model_executor.layers.attention import Attention

    return isinstance(module, Attention)


def _owns_attention(module: nn.Module) -> bool:
    return any(_is_attention(m) for m in module.modules())


def find_block_lists(model: nn.Module) -> list[tuple[str, nn.ModuleList]]:
    """ModuleLists whose real entries own an Attention and are not Attention.

    Found structurally so decoder stacks (``model.layers``), encoder stacks
    (``bert.encoder.layer``) and hybrid stacks are all covered; a list of bare
    Attention layers (e.g. Zamba2's shared ``dpa_list``) is not a block stack.
    """
    from vllm.model_executor.models.utils import PPMissingLayer

    found = []
    for name, module in model.named_modules():
        if not isinstance(module, nn.ModuleList):
            continue
        entries = [m for m in module if not isinstance(m, PPMissingLayer)]
        if not entries or any(_is_attention(m) for m in entries):
            continue
        if all(_owns_attention(m) for m in entries):
            found.append((name, module))
    # A list nested inside a block of another list is not a stack of its own.
    outer = [n for n, _ in found]
    return [(n, m) for n, m in found if not any(n != o and n.startswith(o + ".") for o in outer)]


def compile_model(model: nn.Module) -> str:
    """Compile ``model`` at the configured granularity; returns what was done."""
    from vllm.model_executor.models.utils import PPMissingLayer

    kwargs = dict(backend="inductor", fullgraph=True, dynamic=False)
    granularity = settings.get("SPYRE_COMPILE_GRANULARITY")
    stacks = find_block_lists(model) if granularity == "block" else []
    if not stacks:
        if granularity == "block":
            logger.info("No attention block stack found; compiling the whole model.")
        model.compile(**kwargs)
        return "model"
    n = 0
    for _, stack in stacks:
        for block in stack:
            if not isinstance(block, PPMissingLayer):
                block.compile(**kwargs)
                n += 1
    logger.info("Compiled %d blocks in place (%s)", n, ", ".join(name for name, _ in stacks))
    return "block"


def raise_recompile_limit(min_limit: int) -> None:
    """Let Dynamo keep one entry per bucket (and per block variant) per code object."""
    cfg = torch._dynamo.config
    if cfg.recompile_limit < min_limit:
        cfg.recompile_limit = min_limit
    if cfg.accumulated_recompile_limit < 4 * min_limit:
        cfg.accumulated_recompile_limit = 4 * min_limit
