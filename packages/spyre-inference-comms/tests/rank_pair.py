"""Two real ranks for collective tests: spawned processes in a vLLM distributed environment.

Each rank is a spawned process that sets up the distributed environment the
way vLLM's worker does (``init_distributed_environment`` +
``initialize_model_parallel`` with the installed platform, so the TP group's
device communicator is whatever the platform names), then runs the functions a
test sends it. The pair lives for a whole test module, because starting it
(importing vLLM twice on a two-core machine) costs seconds while a collective
costs microseconds.

A function that raises on every rank leaves the pair usable. A function that
raises on one rank only, or hangs, leaves the other rank stuck in a collective:
the pair is then marked broken, torn down, and the next test starts a fresh one.
"""

from __future__ import annotations

import multiprocessing.connection
import os
import tempfile
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch.multiprocessing as mp

#: Seconds a rank may take for one call before the pair is declared hung.
CALL_TIMEOUT = 300.0
#: Seconds for both ranks to import vLLM and join the process group.
START_TIMEOUT = 300.0
#: After one rank fails, how long the others get to report before the pair is broken.
GRACE = 10.0


class RankError(RuntimeError):
    """A function failed on at least one rank; the message carries each rank's traceback."""

    def __init__(self, errors: dict[int, str]) -> None:
        self.errors = errors
        text = "\n".join(f"--- rank {rank} ---\n{tb}" for rank, tb in sorted(errors.items()))
        super().__init__(f"failed on rank(s) {sorted(errors)}:\n{text}")


def _serve(
    rank: int,
    world_size: int,
    store: str,
    backend: str,
    target: str,
    conn: multiprocessing.connection.Connection,
) -> None:
    """A rank's main loop: set up the distributed environment, then run what arrives."""
    try:
        os.environ["SPYRE_DEVICE_TARGET"] = target
        import torch

        # Two cores, two ranks: one compute thread each (as the worker does).
        torch.set_num_threads(1)
        from vllm.config import VllmConfig, set_current_vllm_config
        from vllm.distributed import (
            destroy_distributed_environment,
            destroy_model_parallel,
            init_distributed_environment,
            initialize_model_parallel,
        )

        if target == "spyre":
            from spyre_inference.platform.distributed_env import export_rank_env

            export_rank_env(rank, rank, world_size)
        with set_current_vllm_config(VllmConfig()):
            init_distributed_environment(
                world_size=world_size,
                rank=rank,
                distributed_init_method=f"file://{store}",
                local_rank=rank,
                backend=backend,
            )
            initialize_model_parallel(tensor_model_parallel_size=world_size)
            conn.send(("ready", None))
            while True:
                message = conn.recv()
                if message is None:
                    break
                fn, args, kwargs = message
                try:
                    conn.send(("ok", fn(*args, **kwargs)))
                except BaseException:
                    conn.send(("err", traceback.format_exc()))
            destroy_model_parallel()
            destroy_distributed_environment()
    except BaseException:
        conn.send(("err", traceback.format_exc()))
    finally:
        conn.close()


class RankPair:
    """``world_size`` ranks (default two) that run module-level functions collectively."""

    def __init__(self, world_size: int = 2, *, backend: str = "gloo", target: str = "cpu") -> None:
        self.world_size = world_size
        self.broken = False
        fd, self._store = tempfile.mkstemp(prefix="spyre-comms-store-")
        os.close(fd)
        os.unlink(self._store)  # FileStore creates it; a stale file would confuse it
        ctx = mp.get_context("spawn")
        self._conns: list[multiprocessing.connection.Connection] = []
        self._procs = []
        for rank in range(world_size):
            parent, child = ctx.Pipe()
            proc = ctx.Process(
                target=_serve,
                args=(rank, world_size, self._store, backend, target, child),
                daemon=True,
                name=f"comms-rank-{rank}",
            )
            proc.start()
            child.close()
            self._conns.append(parent)
            self._procs.append(proc)
        self._collect(START_TIMEOUT, expect="ready")

    def _collect(self, timeout: float, expect: str = "ok") -> list[Any]:
        results: dict[int, Any] = {}
        errors: dict[int, str] = {}
        deadline = time.monotonic() + timeout
        pending = dict(enumerate(self._conns))
        while pending:
            if errors:
                deadline = min(deadline, time.monotonic() + GRACE)
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            for conn in multiprocessing.connection.wait(list(pending.values()), remaining):
                rank = next(r for r, c in pending.items() if c is conn)
                del pending[rank]
                try:
                    status, value = conn.recv()
                except EOFError:
                    status, value = "err", "the rank process exited"
                if status == expect:
                    results[rank] = value
                else:
                    errors[rank] = value
        if pending:
            self.broken = True
            for rank in pending:
                errors.setdefault(rank, f"no answer within {timeout:.0f} s (hung in a collective?)")
        if errors:
            if len(errors) < self.world_size:
                # The ranks that answered may have moved on while the others
                # did not: the group is out of step.
                self.broken = True
            raise RankError(errors)
        return [results[r] for r in range(self.world_size)]

    def run(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> list[Any]:
        """Call ``fn(*args, **kwargs)`` on every rank; the per-rank results in rank order."""
        if self.broken:
            raise RuntimeError("this rank pair is broken; start a new one")
        for conn in self._conns:
            conn.send((fn, args, kwargs))
        return self._collect(CALL_TIMEOUT)

    def close(self) -> None:
        for conn in self._conns:
            try:
                conn.send(None)
            except (BrokenPipeError, OSError):
                pass
        for proc in self._procs:
            proc.join(timeout=10 if not self.broken else 1)
            if proc.is_alive():
                proc.terminate()
                proc.join(timeout=5)
        for conn in self._conns:
            conn.close()
        if os.path.exists(self._store):
            os.unlink(self._store)


class Ranks:
    """A :class:`RankPair` that is replaced by a fresh one when a test breaks it."""

    def __init__(self, **options: Any) -> None:
        self._options = options
        self._pair: RankPair | None = None

    def run(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> list[Any]:
        if self._pair is not None and self._pair.broken:
            self._pair.close()
            self._pair = None
        if self._pair is None:
            self._pair = RankPair(**self._options)
        return self._pair.run(fn, *args, **kwargs)

    def close(self) -> None:
        if self._pair is not None:
            self._pair.close()
            self._pair = None
