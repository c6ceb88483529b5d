"""Numbered steps with elapsed times, and a heartbeat while one step runs long.

Preparing the default model spends 20-60 s inside single library calls
(transformers dequantizing the GGUF, saving safetensors) that report nothing;
without a heartbeat the command looks hung. Each step logs ``[i/n] what``
when it starts, ``still running`` every ``every`` seconds while it runs, and
its duration and the running total when it ends.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Iterator


class Steps:
    """``with steps.step("saving"): ...`` for each of ``total`` steps, in order."""

    def __init__(self, logger: logging.Logger, total: int, every: float = 10.0) -> None:
        self.logger = logger
        self.total = total
        self.every = every
        self.done = 0
        self.started = time.monotonic()

    def elapsed(self) -> float:
        return time.monotonic() - self.started

    @contextlib.contextmanager
    def step(self, what: str) -> Iterator[None]:
        index = self.done + 1
        tag = f"[{index}/{self.total}]"
        self.logger.info("%s %s", tag, what)
        t0 = time.monotonic()
        stop = threading.Event()

        def heartbeat() -> None:
            while not stop.wait(self.every):
                self.logger.info(
                    "%s %s: still running, %.0f s (%.0f s total)",
                    tag,
                    what,
                    time.monotonic() - t0,
                    self.elapsed(),
                )

        thread = threading.Thread(target=heartbeat, name="progress-heartbeat", daemon=True)
        thread.start()
        try:
            yield
        finally:
            stop.set()
            thread.join()
        self.done = index
        self.logger.info(
            "%s done in %.1f s (%.1f s total)", tag, time.monotonic() - t0, self.elapsed()
        )
