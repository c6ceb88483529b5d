"""Shared fixtures for the platform core's tests (tiny models built once per session)."""

from spyre_inference.platform.testing.fixtures import *  # noqa: F403
