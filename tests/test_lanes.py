"""The default run's two lanes (``tests/conftest.py``): tests that start installations,
clusters or containers all run in one xdist lane, one at a time."""

from __future__ import annotations

import pytest


@pytest.mark.integration
def test_an_integration_test_runs_in_the_serial_lane(request: pytest.FixtureRequest) -> None:
    if not getattr(request.config.option, "loadgroup", False):
        pytest.skip("not under xdist's --dist loadgroup (e.g. -n 0 or -p no:xdist)")
    # xdist names a grouped test by its group; a pytest that breaks that (9.2, see
    # pyproject.toml) would spread the installations over both lanes.
    assert request.node.nodeid.endswith("@serial"), request.node.nodeid


def test_a_unit_test_is_in_no_lane(request: pytest.FixtureRequest) -> None:
    assert "@" not in request.node.nodeid
