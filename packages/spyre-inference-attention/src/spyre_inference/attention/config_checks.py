"""Start-up checks of the attention package: what the head-major KV layout cannot
do, and a forced prefill kernel this CPU cannot run.

Published in the core's entry-point group ``spyre_inference.config_checks``;
the platform runs them from ``check_and_update_config``, in the user's process,
before an engine starts. The head-major backend refuses the same
configurations when its layers are built, but that happens in the engine
process, where the message reaches the user only through the log.

The head-major layout has no batched-decode kernel (it gathers whole
token-major pages) and no ALiBi (it would need a bias tile per query group).
Which models use ALiBi is not a config field; the vLLM 0.33 model classes
that pass ALiBi slopes to their attention layers are listed in
:data:`ALIBI_ARCHITECTURES` (Falcon only when its config sets ``alibi``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from spyre_inference.attention import policy
from spyre_inference.platform import device as placement
from spyre_inference.platform import settings

if TYPE_CHECKING:
    from vllm.config import VllmConfig

#: vLLM 0.33 architectures whose attention layers always take ALiBi slopes.
ALIBI_ARCHITECTURES = frozenset({"BloomForCausalLM", "Step1ForCausalLM"})
#: ... and those that do when their config sets ``alibi``.
_ALIBI_FLAG_ARCHITECTURES = frozenset({"FalconForCausalLM", "RWForCausalLM"})


class HeadMajorConfigError(ValueError):
    """A setting asks the head-major layout for something it does not have."""


def uses_alibi(model_config: Any) -> bool:
    """Whether vLLM builds this model's attention with ALiBi slopes."""
    archs = set(getattr(model_config.hf_config, "architectures", None) or ())
    archs.add(model_config.architecture)
    if archs & ALIBI_ARCHITECTURES:
        return True
    return bool(archs & _ALIBI_FLAG_ARCHITECTURES) and bool(
        getattr(model_config.hf_config, "alibi", False)
    )


def check_batched_decode() -> None:
    """An explicit SPYRE_BATCHED_DECODE=1 is refused on the head-major layout.

    The default (on) is not a request: the head-major backend simply does not
    batch decodes.
    """
    if policy.explicitly_set("SPYRE_BATCHED_DECODE") and policy.batched_decode_requested():
        raise HeadMajorConfigError(
            "SPYRE_BATCHED_DECODE=1 is not available with SPYRE_ATTN_KV_LAYOUT=head_major: "
            "the batched-decode kernel gathers whole token-major pages. Unset "
            "SPYRE_BATCHED_DECODE (or set it to 0), or use SPYRE_ATTN_KV_LAYOUT=token_major."
        )


def check_head_major(vllm_config: VllmConfig) -> None:
    """Refuse batched decode and ALiBi models when the head-major layout is selected."""
    if settings.get("SPYRE_ATTN_KV_LAYOUT") != "head_major":
        return
    check_batched_decode()
    model_config = vllm_config.model_config
    if model_config is not None and uses_alibi(model_config):
        raise HeadMajorConfigError(
            f"SPYRE_ATTN_KV_LAYOUT=head_major cannot serve {model_config.architecture}: the "
            "model uses ALiBi, which the head-major layout does not implement (it would need "
            "a bias tile per query group). Unset SPYRE_ATTN_KV_LAYOUT or set it to "
            "token_major, which supports ALiBi."
        )


def check_prefill_kernel(vllm_config: VllmConfig) -> None:
    """``SPYRE_CPU_PREFILL_KERNEL=plugin`` is refused on a host that cannot run it.

    Left to the engine, the first long prompt would fail there. Building the
    kernel (about a second) happens only when the setting forces it.
    """
    if settings.get("SPYRE_CPU_PREFILL_KERNEL") != "plugin" or placement.is_spyre():
        return
    from spyre_inference.attention.ops import host_prefill

    reason = host_prefill.kernel_unavailable_reason()
    if reason is not None:
        raise ValueError(
            f"SPYRE_CPU_PREFILL_KERNEL=plugin cannot be used here: {reason}. Unset "
            "SPYRE_CPU_PREFILL_KERNEL (auto uses the kernel where the CPU has AVX-512 BF16) "
            "or set it to torch."
        )


__all__ = [
    "ALIBI_ARCHITECTURES",
    "HeadMajorConfigError",
    "check_batched_decode",
    "check_head_major",
    "check_prefill_kernel",
    "uses_alibi",
]
