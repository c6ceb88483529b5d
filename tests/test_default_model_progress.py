"""The default model's preparation reports numbered steps, durations and a heartbeat."""

from __future__ import annotations

import logging
import re
import time

import pytest

from spyre_inference.default_model._progress import Steps


def test_steps_log_counts_heartbeats_and_elapsed(caplog: pytest.LogCaptureFixture) -> None:
    logger = logging.getLogger("test-progress")
    steps = Steps(logger, total=2, every=0.05)
    with caplog.at_level(logging.INFO, logger="test-progress"):
        with steps.step("quick"):
            pass
        with steps.step("slow"):
            time.sleep(0.3)
    lines = [r.getMessage() for r in caplog.records]
    assert lines[0] == "[1/2] quick"
    assert re.fullmatch(r"\[1/2\] done in \d+\.\d s \(\d+\.\d s total\)", lines[1])
    assert lines[2] == "[2/2] slow"
    beats = [m for m in lines if m.startswith("[2/2] slow: still running")]
    # About six at 0.05 s intervals; fewer when the machine is loaded, never none.
    assert 1 <= len(beats) <= 6, lines
    assert re.fullmatch(r"\[2/2\] done in \d+\.\d s \(\d+\.\d s total\)", lines[-1])
    assert steps.done == 2
