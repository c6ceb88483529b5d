"""``serve_exit``: a process armed by vLLM's CLI exits 1 after vLLM logs its engine's death.

Each case runs in a fresh interpreter, because the module acts at interpreter
exit. The engine's death is simulated by logging the record vLLM 0.33's
``AsyncLLM.output_handler`` writes (same logger, same function name, an
exception attached); the end-to-end case, a real worker killed under a real
``vllm serve``, is ``tests/test_serve_engine_fault.py``.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

SCRIPT = """
import logging
from spyre_inference.platform import serve_exit

if {armed}:
    serve_exit.arm()
    serve_exit.arm()  # idempotent
log = logging.getLogger(serve_exit.ENGINE_LOGGER)

def {function}():
    try:
        raise RuntimeError("engine core died")
    except RuntimeError:
        log.exception("AsyncLLM output_handler failed.")

{function}()
print("main finished")
"""


def _exit_status(armed: bool, function: str) -> subprocess.CompletedProcess:
    code = textwrap.dedent(SCRIPT.format(armed=armed, function=function))
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize(
    ("armed", "function", "status"),
    [
        (True, "output_handler", 1),  # vllm serve whose engine died
        (False, "output_handler", 0),  # an application embedding vLLM keeps its status
        (True, "some_other_function", 0),  # another error of that module is not a death
    ],
)
def test_exit_status(armed, function, status) -> None:
    result = _exit_status(armed, function)
    assert result.returncode == status, result.stderr[-2000:]
    assert "main finished" in result.stdout
    if status:
        assert "the engine died while serving; exiting with status 1" in result.stdout + (
            result.stderr
        )
