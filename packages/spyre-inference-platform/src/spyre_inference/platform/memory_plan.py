"""The host-memory plan of the cpu target: what the KV cache may take.

On the cpu target the host's memory holds the model, the KV cache *and*
everything warm-up and serving allocate: Inductor's compile state, one dummy
step per token bucket, and each step's activations and float32 logits over the
whole vocabulary. vLLM's GPU worker measures a profiling step's peak and gives
the cache what is left; vLLM's CPU worker gives the cache a share of the host
with no headroom at all. A cache sized like that leaves warm-up too little, and
the kernel OOM-kills the engine (issue 21: a 262,144-token vocabulary in
float32 on a 24 GB host). So the cache gets, at most, what is left after a
reserve for the step peak, computed from the configuration (:func:`step_reserve`),
and an engine that cannot hold one full-length sequence is refused with the
numbers instead of being killed later.
"""

from __future__ import annotations

import dataclasses
import json
import resource
import struct
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from vllm.config import VllmConfig

GiB = 1 << 30
MiB = 1 << 20


def size_text(nbytes: float) -> str:
    """``nbytes`` for a message: GiB, or MiB below a tenth of one (a tiny model's
    cache would otherwise read "0.00 GiB")."""
    if abs(nbytes) < GiB / 10:
        return f"{nbytes / MiB:.1f} MiB"
    return f"{nbytes / GiB:.2f} GiB"


#: Inductor and Dynamo state built while warm-up compiles every bucket's block
#: graphs, plus Inductor's compile worker processes and the C++ compiler,
#: which take host memory outside the worker's RSS. tests/test_memory_plan.py
#: checks the whole reserve against a measured peak.
COMPILE_RESERVE = 2 * GiB
#: float32 [rows, vocab] tensors alive at once in a sampling step: the LM
#: head's logits, the sampler's processed copy and its (log-)softmax.
LOGITS_COPIES = 3
#: A block graph's intermediates and the next block's input coexist.
ACTIVATION_COPIES = 2


@dataclasses.dataclass(frozen=True)
class StepShape:
    """What bounds one step's transient memory."""

    max_tokens: int  # the largest num_tokens bucket a step runs at
    sampled_rows: int  # logits rows a step can produce (max_num_seqs x (1 + spec tokens))
    hidden_size: int
    intermediate_size: int
    qkv_size: int  # q + k + v features of one token
    vocab_size: int
    num_heads: int  # query heads on this rank
    max_model_len: int


def peak_rss_bytes() -> int:
    """This process's peak resident set so far (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def step_reserve(shape: StepShape) -> dict[str, int]:
    """Bytes to keep free for warm-up and the largest step, by component.

    Activations are counted in float32 (the cpu target's GEMMs produce float32
    before the cast back) for the largest per-token live set of a decoder
    block: residual, normed input, QKV, attention output, and the MLP's
    gate/up and activated halves. A prefill chunk of ``max_tokens`` tokens at
    the end of a ``max_model_len`` sequence also holds float32 attention scores
    and their softmax for every head over every key: ``heads x tokens x
    max_model_len`` (warm-up records that variant too). Seen without this term:
    Gemma-3-270M in float32 with ``LLM()`` defaults (8192-token chunks, 32768
    keys, 4 heads) was OOM-killed in attention warm-up. The core cannot tell
    which attention path a layer takes (the attention package decides), so the
    term is kept for all: layers on the cpu target's host kernels, which read
    pages in place or through the flash kernel's own tiles, need far less.
    """
    per_token = 4 * shape.hidden_size + shape.qkv_size + 3 * shape.intermediate_size
    return {
        "activations": shape.max_tokens * per_token * 4 * ACTIVATION_COPIES,
        "attention": shape.num_heads * shape.max_tokens * shape.max_model_len * 4 * 2,
        "logits": shape.sampled_rows * shape.vocab_size * 4 * LOGITS_COPIES,
        "compile": COMPILE_RESERVE,
    }


@dataclasses.dataclass(frozen=True)
class HostMemoryPlan:
    """The KV budget on the host and how it was reached (all bytes)."""

    total: int
    available: int
    worker_rss: int
    utilization: float
    reserve: dict[str, int]
    full_batch_kv: int  # what max_num_seqs full-length sequences use, twice over
    one_sequence_kv: int  # one full-length sequence
    kv_bytes: int

    @property
    def reserve_bytes(self) -> int:
        return sum(self.reserve.values())

    def describe(self) -> str:
        parts = ", ".join(f"{k} {v / GiB:.2f}" for k, v in self.reserve.items())
        return (
            f"KV cache {self.kv_bytes / GiB:.2f} GiB (host {self.total / GiB:.1f} GiB, "
            f"available {self.available / GiB:.2f}, worker RSS {self.worker_rss / GiB:.2f}, "
            f"reserve for warm-up and steps {self.reserve_bytes / GiB:.2f} [{parts}], "
            f"max_num_seqs full sequences x2 {self.full_batch_kv / GiB:.2f})"
        )


def plan_host_kv(
    *,
    total: int,
    available: int,
    worker_rss: int,
    utilization: float,
    reserve: dict[str, int],
    full_batch_kv: int,
    one_sequence_kv: int,
) -> HostMemoryPlan:
    """The KV budget: the smallest of the user's share of the host, what is
    available after the reserve, and what max_num_seqs full sequences use.

    Raises ``ValueError`` naming the numbers and the flags to change when the
    result cannot hold one full-length sequence.
    """
    share = int(total * utilization) - worker_rss
    after_reserve = available - sum(reserve.values())
    kv = min(share, after_reserve)
    if full_batch_kv > 0:
        kv = min(kv, full_batch_kv)
    plan = HostMemoryPlan(
        total, available, worker_rss, utilization, reserve, full_batch_kv, one_sequence_kv, kv
    )
    if kv < max(one_sequence_kv, 1):
        limit = (
            f"gpu_memory_utilization={utilization} of the host grants {size_text(share)} "
            f"beyond the worker's {size_text(worker_rss)}"
            if share <= after_reserve
            else f"the host has {size_text(available)} available and warm-up and serving "
            f"need {size_text(plan.reserve_bytes)} of it ("
            + ", ".join(f"{k} {size_text(v)}" for k, v in reserve.items())
            + ")"
        )
        raise ValueError(
            f"Not enough host memory for the KV cache: one sequence of max_model_len tokens "
            f"needs {size_text(one_sequence_kv)}, but {limit}, which leaves "
            f"{size_text(max(kv, 0))}. Lower --max-model-len or --max-num-seqs / "
            "--max-num-batched-tokens, use a 16-bit --dtype, raise --gpu-memory-utilization, "
            "or set --kv-cache-memory-bytes."
        )
    return plan


def _checkpoint_parameters(model: str) -> int:
    """Parameters in a local checkpoint's safetensors files (their headers only); 0 if unknown."""
    folder = Path(model)
    if not folder.is_dir():
        return 0
    count = 0
    for file in folder.glob("*.safetensors"):
        with file.open("rb") as f:
            (size,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(size))
        for name, entry in header.items():
            if name != "__metadata__":
                numel = 1
                for dim in entry["shape"]:
                    numel *= dim
                count += numel
    return count


def step_shape(vllm_config: VllmConfig, max_tokens: int) -> StepShape:
    """One worker's :class:`StepShape` for steps of at most ``max_tokens`` tokens."""
    mc, pc, sc = vllm_config.model_config, vllm_config.parallel_config, vllm_config.scheduler_config
    hidden, head = mc.get_hidden_size(), mc.get_head_size()
    intermediate = getattr(mc.hf_text_config, "intermediate_size", None) or 4 * hidden
    spec = vllm_config.speculative_config
    spec_tokens = spec.num_speculative_tokens if spec is not None else 0
    heads = mc.get_num_attention_heads(pc)
    return StepShape(
        max_tokens=max_tokens,
        sampled_rows=0 if mc.runner_type == "pooling" else sc.max_num_seqs * (1 + spec_tokens),
        hidden_size=hidden,
        intermediate_size=intermediate // pc.tensor_parallel_size,
        qkv_size=head * (heads + 2 * mc.get_num_kv_heads(pc)),
        vocab_size=mc.get_vocab_size(),
        num_heads=heads,
        max_model_len=mc.max_model_len,
    )


def startup_lower_bound(vllm_config: VllmConfig) -> dict[str, int]:
    """What the engine needs on the host at the least, by component (bytes).

    Computed in the user's process from the configuration and the checkpoint's
    headers, before any engine starts: the weights once in the serving dtype
    (the layers' derived copies come on top), the KV cache of one sequence of
    ``max_model_len`` tokens (or ``--kv-cache-memory-bytes``), and each
    worker's warm-up and step reserve. Sliding-window layers are counted at
    their window, so the sum never overstates the need.
    """
    mc, pc, sc = vllm_config.model_config, vllm_config.parallel_config, vllm_config.scheduler_config
    text = mc.hf_text_config
    dtype_bytes = mc.dtype.itemsize
    tp = pc.tensor_parallel_size
    head = mc.get_head_size()
    explicit_kv = vllm_config.cache_config.kv_cache_memory_bytes
    if explicit_kv:
        kv = int(explicit_kv) * tp
    else:
        window = getattr(text, "sliding_window", None) or mc.max_model_len
        tokens = min(mc.max_model_len, window)
        layers = mc.get_num_layers(pc)
        kv = 2 * mc.get_num_kv_heads(pc) * tp * head * layers * tokens * dtype_bytes
    reserve = step_reserve(step_shape(vllm_config, sc.max_num_batched_tokens))
    need = {"weights": _checkpoint_parameters(mc.model) * dtype_bytes, "kv_one_sequence": kv}
    need.update({f"{k} (x{tp} workers)" if tp > 1 else k: v * tp for k, v in reserve.items()})
    return need


__all__ = [
    "COMPILE_RESERVE",
    "GiB",
    "HostMemoryPlan",
    "MiB",
    "StepShape",
    "peak_rss_bytes",
    "plan_host_kv",
    "size_text",
    "startup_lower_bound",
    "step_reserve",
    "step_shape",
]
