"""The call boundary between the runner (host) and the model (device).

Spec: "_SpyreModelWrapper sits between the model runner and the model and
converts at the call boundary". It is invoked from the runner's
``_model_forward`` (vLLM's documented override point) rather than installed
as ``runner.model``: vLLM inspects ``runner.model`` with ``isinstance`` for
model capabilities (pooling, multimodal, MoE), which a wrapper would hide.

* input: host int32/int64 token ids and positions -> device int64 (the
  embedding and RoPE gathers index with them);
* output: device hidden states -> host (logits indexing and sampling run on
  the host).

On the cpu target both conversions are identity operations.

The wrapper also decides how much of Dynamo's guard checking a step pays
(:class:`SettledGuards`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

from spyre_inference.platform import device as dev
from spyre_inference.platform import direct_block_calls
from spyre_inference.platform.logs import get_logger

logger = get_logger(__name__)


class SettledGuards:
    """Run a step with only Dynamo's differentiating guards once its bucket is settled.

    Why: every compiled block call evaluates its full guard tree (module
    attributes, parameters, globals), about 70 us per call on this host and
    a measurable share of a batch-1 decode step. With
    ``torch.compiler.set_stance(skip_guard_eval_unsafe=True)`` Dynamo only
    checks the guards that tell its cached graphs apart (here: the bucket's
    shapes and the block variant).

    That is only sound when no step can need a graph Dynamo does not already
    hold, so a num_tokens bucket is *settled* in two stages:

    1. warm-up compiled it (``arm``): every step is padded onto a bucket, and a
       step of another size (none is expected) always gets full guards;
    2. its first served step ran with full guards and added no graph to the
       compiled model (``graph_count``). A step that did is the bug warm-up
       exists to prevent: it is logged, and that bucket keeps full guards for
       the rest of the process.

    In a settled bucket the compiled blocks are also called past Dynamo's frame
    evaluation (:mod:`~spyre_inference.platform.direct_block_calls`,
    ``SPYRE_DIRECT_BLOCK_CALLS``): each call signature's graph is chosen once
    with full guards, then run directly.

    Attention kernels compiled by ``torch.compile`` inside a step see the same
    stance; each of their variants is its own code object with exactly one
    graph, selected by a key that mirrors Dynamo's guards
    (``spyre_inference.attention.ops.compiled``), so skipping guards there
    cannot pick a wrong graph either.
    """

    def __init__(self) -> None:
        self._armed: frozenset[int] = frozenset()
        self._graph_count: Callable[[], int] = lambda: 0
        self._settled: set[int] = set()
        self._unsettled: set[int] = set()

    def arm(self, buckets: Iterable[int], graph_count: Callable[[], int]) -> None:
        """Called at the end of warm-up with the buckets it compiled."""
        self._armed = frozenset(buckets)
        self._graph_count = graph_count
        self._settled.clear()
        self._unsettled.clear()

    @property
    def settled(self) -> frozenset[int]:
        return frozenset(self._settled)

    def run(self, num_tokens: int, call: Any) -> Any:
        if num_tokens in self._settled:
            try:
                with (
                    torch.compiler.set_stance("default", skip_guard_eval_unsafe=True),
                    direct_block_calls.direct_calls(),
                ):
                    return call()
            except RuntimeError as exc:
                # Dynamo refuses to compile under this stance when no cached
                # graph passes the differentiating guards. Nothing of the step
                # is lost by running it again: the blocks that ran are pure
                # functions of their inputs, and the KV cache writes put the
                # same values into the same slots.
                if "skip_guard_eval_unsafe" not in str(exc):
                    raise
                self._settled.discard(num_tokens)
                self._unsettled.add(num_tokens)
                logger.warning(
                    "A step of %d tokens needed a graph warm-up did not compile; that "
                    "bucket goes back to full Dynamo guard checks. Please report the "
                    "model and request.",
                    num_tokens,
                )
                return call()
        if num_tokens not in self._armed or num_tokens in self._unsettled:
            return call()
        graphs = self._graph_count()
        out = call()
        if self._graph_count() == graphs:
            self._settled.add(num_tokens)
        else:
            self._unsettled.add(num_tokens)
            logger.warning(
                "A served step of %d tokens compiled a new graph after warm-up; that "
                "bucket keeps full Dynamo guard checks. Please report the model and request.",
                num_tokens,
            )
        return out


class _SpyreModelWrapper:
    """Converts at the model's call boundary and runs each step under :class:`SettledGuards`.

    On the card path the conversions are forward hooks on the model itself
    (PyTorch's own extension point), so every call of the model crosses the
    boundary the same way: the runner's steps through this wrapper and the
    calls vLLM's runner makes on ``runner.model`` directly (its
    ``_dummy_run``, which warm-up uses). On the cpu target the conversions
    only count (the card's copies, a cost proxy) and stay in this call, out of
    reach of a whole-model compile.
    """

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.guards = SettledGuards()
        self._hooked = dev.is_spyre()
        if self._hooked:
            model.register_forward_pre_hook(_inputs_to_device, with_kwargs=True)
            model.register_forward_hook(_output_to_host)

    def __call__(
        self,
        input_ids: torch.Tensor | None = None,
        positions: torch.Tensor | None = None,
        **kwargs: Any,
    ) -> Any:
        num_tokens = _num_tokens(input_ids, positions, kwargs.get("inputs_embeds"))
        if self._hooked:
            return self.guards.run(
                num_tokens,
                lambda: self.model(input_ids=input_ids, positions=positions, **kwargs),
            )
        if input_ids is not None:
            input_ids = _index_to_device(input_ids)
        if positions is not None:
            positions = _index_to_device(positions)
        out = self.guards.run(
            num_tokens,
            lambda: self.model(input_ids=input_ids, positions=positions, **kwargs),
        )
        return _output_to_host(self.model, (), out)


def _inputs_to_device(
    module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """Token ids and positions (host int32/int64) -> device int64, for the gathers;
    prompt embeddings, kept on the host with ``--enable-prompt-embeds`` (see the
    runner), -> device."""
    args = list(args)
    for i, name in enumerate(("input_ids", "positions")):
        if name in kwargs:
            if kwargs[name] is not None:
                kwargs[name] = _index_to_device(kwargs[name])
        elif i < len(args) and args[i] is not None:
            args[i] = _index_to_device(args[i])
    embeds = kwargs.get("inputs_embeds")
    if embeds is not None and embeds.device.type == "cpu":
        kwargs["inputs_embeds"] = dev.to_device(embeds)
    return tuple(args), kwargs


def _output_to_host(module: nn.Module, args: tuple[Any, ...], out: Any) -> Any:
    """Hidden states -> host (logits indexing and sampling run there)."""
    return dev.to_host(out) if isinstance(out, torch.Tensor) else out


def _num_tokens(
    input_ids: torch.Tensor | None,
    positions: torch.Tensor | None,
    inputs_embeds: torch.Tensor | None,
) -> int:
    """The step's (padded) token count; -1 when the call carries none."""
    if positions is not None:
        # M-RoPE positions are [3, num_tokens].
        return int(positions.shape[-1])
    if input_ids is not None:
        return int(input_ids.shape[0])
    if inputs_embeds is not None:
        return int(inputs_embeds.shape[0])
    return -1


def _index_to_device(t: torch.Tensor) -> torch.Tensor:
    if not dev.is_spyre():
        # The host embedding takes the runner's int32 ids as they are; the
        # card's copy is still counted (a cost proxy).
        dev.note_transfer("h2d")
        return t
    return dev.to_device(t, dtype=torch.int64)
