"""Tests of the deployment files; the container ones share what they need to start."""

from __future__ import annotations

import os

import pytest

BASE_IMAGE = os.environ.get("SHOAL_BASE_IMAGE", "localhost/shoal-base:bookworm")
"""The Debian base the images are built from (``.ci/run`` makes it with debootstrap)."""


def unavailable(reason: str) -> None:
    """Skip a container test that cannot run here; under CI (``CI`` set) fail it instead."""
    if os.environ.get("CI"):
        pytest.fail(f"{reason} (under CI the container test must run)")
    pytest.skip(reason)
