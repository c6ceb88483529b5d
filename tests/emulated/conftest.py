"""Tests of the emulated Spyre card (``SPYRE_DEVICE_TARGET=emulated``).

The target is chosen once per process, so these run in their own pytest
process: the nox session ``emulated`` sets the variable. Under any other target
(the e2e session collects this folder too) every test here is skipped.
"""

from __future__ import annotations

import pytest

from spyre_inference.platform import device


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if device.target() is device.DeviceTarget.EMULATED:
        return
    skip = pytest.mark.skip(reason="needs SPYRE_DEVICE_TARGET=emulated (nox -s emulated)")
    here = str(config.rootpath / "tests" / "emulated")
    for item in items:
        if str(item.path).startswith(here):
            item.add_marker(skip)
