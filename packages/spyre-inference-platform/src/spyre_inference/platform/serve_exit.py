"""`vllm serve` exits with status 1, not 0, when its engine died while serving.

When the engine core (or a worker of it) dies, vLLM 0.33's API server answers
``/health`` with 503, fails the requests in flight, and its watchdog shuts the
server down — but the process then exits with status 0, as after a normal
stop (vllm-project/vllm#48966, open). A supervisor (systemd
``Restart=on-failure``, Kubernetes, a shell ``&&``) then takes the fault for a
clean exit. vLLM offers no hook for this, so the plugin adds the smallest
possible one, in the API-server process only:

* the signal is vLLM's own: ``AsyncLLM``'s output handler logs its failure
  (``logger.exception("AsyncLLM output_handler failed.")``, with the
  ``EngineDeadError`` attached) when the engine is gone; a logging handler on
  that module's logger notes it;
* the same record is also written when the server stops on request and its
  engine goes down first (a SIGTERM to the whole process group, as ``systemd``
  or Ctrl-C send it, races the engine's shutdown against the output handler's
  cancellation). vLLM's engine-process manager tells the two apart: when the
  server stops the engine it sets ``manager_stopped`` first, and an engine
  process that exits non-zero while the manager is not stopping is recorded in
  ``failed_proc_name``. The handler reads both from the failing
  ``output_handler`` frame (its ``engine_core`` client) and ignores a failure
  during a requested stop;
* at interpreter exit, after vLLM's own shutdown has run, an ``atexit``
  callback turns a noted failure into exit status :data:`EXIT_STATUS`
  (``os._exit``, after flushing logging and the standard streams: Python
  ignores ``SystemExit`` raised in an ``atexit`` callback).

It is armed only in a process whose command line was parsed by vLLM's CLI
(the platform's ``pre_register_and_update`` receives the parser there), so an
application embedding vLLM keeps its own exit status.
"""

from __future__ import annotations

import atexit
import logging
import os
import sys
import threading
from types import TracebackType

from spyre_inference.platform.logs import get_logger

logger = get_logger(__name__)

#: The exit status of a server whose engine died.
EXIT_STATUS = 1

#: Where vLLM 0.33 logs the death of the engine, as seen by the API server.
ENGINE_LOGGER = "vllm.v1.engine.async_llm"
OUTPUT_HANDLER = "output_handler"


class EngineDeathWatch(logging.Handler):
    """Notes vLLM's "AsyncLLM output_handler failed" record; emits nothing itself."""

    def __init__(self) -> None:
        super().__init__(level=logging.ERROR)
        self.engine_died = False

    def emit(self, record: logging.LogRecord) -> None:
        if record.funcName != OUTPUT_HANDLER or record.exc_info is None:
            return
        if not _requested_stop(record.exc_info[2]):
            self.engine_died = True


def _requested_stop(tb: TracebackType | None) -> bool:
    """Whether the server itself was stopping its engine when the output handler failed.

    Read from vLLM 0.33's engine-process manager, reached through the
    ``engine_core`` client of the failing ``output_handler`` frame. Without a
    manager (engines not started by this process) or when vLLM's internals
    differ, the failure counts as a death.
    """
    if tb is None:
        return False
    engine_core = tb.tb_frame.f_locals.get("engine_core")
    manager = getattr(getattr(engine_core, "resources", None), "engine_manager", None)
    stopping = getattr(manager, "manager_stopped", None)
    if not isinstance(stopping, threading.Event):
        return False
    return stopping.is_set() and getattr(manager, "failed_proc_name", None) is None


_watch: EngineDeathWatch | None = None


def arm() -> None:
    """Watch for engine death in this (vLLM CLI) process; idempotent.

    Also called again once the config is built: vLLM may reconfigure logging
    after parsing the command line, which drops handlers of child loggers.
    """
    global _watch
    if _watch is None:
        _watch = EngineDeathWatch()
        atexit.register(_exit_if_engine_died)
    engine_logger = logging.getLogger(ENGINE_LOGGER)
    if _watch not in engine_logger.handlers:
        engine_logger.addHandler(_watch)


def rearm() -> None:
    """Re-attach the watch if this process was armed (no-op otherwise)."""
    if _watch is not None:
        arm()


def engine_died() -> bool:
    return _watch is not None and _watch.engine_died


def _exit_if_engine_died() -> None:
    if not engine_died():
        return
    logger.error(
        "spyre-inference: the engine died while serving; exiting with status %d "
        "(vLLM itself would exit 0).",
        EXIT_STATUS,
    )
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(EXIT_STATUS)


__all__ = ["ENGINE_LOGGER", "EXIT_STATUS", "EngineDeathWatch", "arm", "engine_died", "rearm"]
