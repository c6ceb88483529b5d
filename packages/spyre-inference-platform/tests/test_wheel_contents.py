"""The platform wheel carries no test code; the tests' helpers come from their own distribution.

Read from the installed distributions' file lists (the nox session installs the
built wheels, not the source tree), so this is what a user's ``pip install``
gets.
"""

from __future__ import annotations

import importlib.metadata as md
from pathlib import Path

import spyre_inference.testing


def _python_files(dist: str) -> list[md.PackagePath]:
    return [f for f in md.files(dist) or () if f.suffix == ".py"]


def test_the_platform_wheel_holds_no_test_helpers() -> None:
    files = _python_files("spyre-inference-platform")
    assert files, "the platform distribution lists no Python files"
    helpers = [str(f) for f in files if "testing" in f.parts or f.name == "conftest.py"]
    assert not helpers, helpers
    importing_pytest = [
        str(f) for f in files if "import pytest" in Path(f.locate()).read_text(errors="replace")
    ]
    assert not importing_pytest, importing_pytest


def test_the_helpers_come_from_the_testing_distribution() -> None:
    located = {Path(f.locate()).resolve() for f in _python_files("spyre-inference-testing")}
    assert Path(spyre_inference.testing.__file__).resolve() in located
    plugins = {ep.value for ep in md.entry_points(group="pytest11")}
    assert "spyre_inference.testing.fixtures" in plugins, plugins
