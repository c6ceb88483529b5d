"""The default model's setting (entry point ``spyre_inference.settings: default_model``).

Collected by the core with every installed package's settings
(``spyre_inference.platform.settings.all_settings``).
"""

from __future__ import annotations

from spyre_inference.platform.settings import Setting, folder

SETTINGS: tuple[Setting, ...] = (
    Setting(
        "SPYRE_DEFAULT_MODEL_DIR",
        "",
        "Folder of the embedded default model (SmolLM2-135M-Instruct converted to a "
        "dense checkpoint by `spyre-prepare-default-model`). Empty: "
        "`$XDG_CACHE_HOME/spyre-inference/models/smollm2-135m-instruct` "
        "(`~/.cache/...` when XDG_CACHE_HOME is unset).",
        parse=folder,
    ),
)
