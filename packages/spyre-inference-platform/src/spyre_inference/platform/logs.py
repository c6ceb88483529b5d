"""Loggers for the plugin, placed inside vLLM's logger tree.

vLLM configures only the ``vllm`` logger tree (format, level from
VLLM_LOGGING_LEVEL, and lazily, after plugins load); loggers named
``spyre_inference.*`` would fall through to Python's last-resort handler and
drop INFO lines such as warm-up progress. Naming ours ``vllm.spyre_inference.*``
makes them inherit vLLM's handlers and level in every process.
"""

from __future__ import annotations

from vllm.logger import init_logger


def get_logger(name: str):
    return init_logger(f"vllm.{name}")
