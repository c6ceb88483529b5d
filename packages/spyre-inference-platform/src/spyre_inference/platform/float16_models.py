"""Model types vLLM refuses in float16, served on the card path anyway.

vLLM 0.33 refuses Gemma 2, Gemma 3 and GLM-4 in float16 before it builds an
engine (``vllm.config.model._FLOAT16_NOT_SUPPORTED_MODELS``: "Numerical
instability. Please use bfloat16 or float32 instead."), advice for a GPU, which
can choose bfloat16. A Spyre card computes in float16 only (spec, "Device
targets"), so on the card path that refusal would leave these models with no
way to run at all. There the plugin lifts it and warns once with vLLM's reason:
the risk is the model's activations leaving float16's range, which the emulated
target's tests compare against transformers in float16. The cpu target keeps
vLLM's rule (it has bfloat16).

vLLM has no hook for this table, so this is a runtime patch, kept here alone;
the platform applies it in ``pre_register_and_update``, which vLLM calls before
it builds the model config.
"""

from __future__ import annotations

from spyre_inference.platform.logs import get_logger

logger = get_logger(__name__)

#: model_type -> vLLM's reason, for the types this process lifted.
lifted: dict[str, str] = {}


def allow_on_card_path() -> None:
    """Drop vLLM's float16 refusals (idempotent); call only on the card path."""
    from vllm.config import model as model_config

    table: dict[str, str] | None = getattr(model_config, "_FLOAT16_NOT_SUPPORTED_MODELS", None)
    if not table:
        return
    for model_type in list(table):
        lifted[model_type] = table.pop(model_type)
    logger.warning(
        "Spyre card path: serving %s in float16, the card's only dtype, although vLLM "
        "refuses them in float16 on other platforms (%s)",
        ", ".join(sorted(lifted)),
        next(iter(lifted.values())),
    )


__all__ = ["allow_on_card_path", "lifted"]
