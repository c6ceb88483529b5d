"""``cpu_allocator``: tcmalloc goes first in ``LD_PRELOAD`` for the engine processes.

The engine-level check (a ``vllm serve`` engine process has it mapped) is in the
repository's ``tests/test_default_model_serve.py``.
"""

from __future__ import annotations

import os

import pytest

from spyre_inference.platform import cpu_allocator, settings


@pytest.fixture(autouse=True)
def _fresh(monkeypatch):
    monkeypatch.delenv("LD_PRELOAD", raising=False)
    monkeypatch.delenv("SPYRE_CPU_TCMALLOC", raising=False)
    settings.reset_cache()
    yield
    settings.reset_cache()


def test_prepended_and_other_preloads_kept(monkeypatch) -> None:
    library = cpu_allocator.find_tcmalloc()
    if library is None:
        pytest.skip(f"no tcmalloc on this machine ({cpu_allocator.TCMALLOC_PACKAGE})")
    monkeypatch.setenv("LD_PRELOAD", "/opt/other.so")
    assert cpu_allocator.preload_tcmalloc() == library
    assert os.environ["LD_PRELOAD"] == f"{library}:/opt/other.so"
    # A second config check (another engine in this process) adds nothing.
    assert cpu_allocator.preload_tcmalloc() is None
    assert os.environ["LD_PRELOAD"] == f"{library}:/opt/other.so"


def test_alone_when_nothing_was_preloaded() -> None:
    library = cpu_allocator.find_tcmalloc()
    if library is None:
        pytest.skip(f"no tcmalloc on this machine ({cpu_allocator.TCMALLOC_PACKAGE})")
    assert cpu_allocator.preload_tcmalloc() == library
    assert os.environ["LD_PRELOAD"] == library


def test_off_and_a_users_own_tcmalloc_are_left_alone(monkeypatch) -> None:
    monkeypatch.setenv("SPYRE_CPU_TCMALLOC", "off")
    settings.reset_cache()
    assert cpu_allocator.preload_tcmalloc() is None
    assert "LD_PRELOAD" not in os.environ
    monkeypatch.setenv("SPYRE_CPU_TCMALLOC", "auto")
    monkeypatch.setenv("LD_PRELOAD", "/home/me/libtcmalloc.so")
    settings.reset_cache()
    assert cpu_allocator.preload_tcmalloc() is None
    assert os.environ["LD_PRELOAD"] == "/home/me/libtcmalloc.so"
