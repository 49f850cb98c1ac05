"""Shared fixtures: a real nats-server on a free port with a temporary store.

Layers: store dir -> server (one per test session) -> bus (one per test, with a
unique subject prefix and therefore unique streams, so tests never see each
other's events and could run in parallel).
"""

from __future__ import annotations

import itertools
import os
from collections.abc import AsyncIterator, Iterator
from typing import Any

import pytest
from hypothesis import settings
from shoal.auth import CredentialStore, Role
from shoal.bus import Bus
from shoal.nats_server import EmbeddedNats, LocalCluster

_prefixes = itertools.count(1)

# No per-example deadline: an example of a few ms that a loaded 2-core CI machine stalls
# past hypothesis's default 200 ms is not a failure (pytest-timeout still bounds a hang).
settings.register_profile("shoal", deadline=None)
settings.load_profile("shoal")

SERIAL_MARKERS = ("integration", "slow", "container", "gpu")
"""Tests that start installations, clusters or containers, or train: one xdist lane runs
them one at a time (``xdist_group``), so each has the machine as it would alone bar
the other lane, which takes the rest (``-n 2 --dist loadgroup`` in ``addopts``). Tests
that start a NATS cluster (fixture ``nats_cluster``) go there too: two clusters started at
once in two lanes failed (a 3-replica stream unavailable, a leader election too slow)."""


def pytest_itemcollected(item: pytest.Item) -> None:
    # At collection, before any pytest_collection_modifyitems: xdist names each item by its
    # group in its own.
    fixtures = getattr(item, "fixturenames", ())
    if any(item.get_closest_marker(m) for m in SERIAL_MARKERS) or "nats_cluster" in fixtures:
        item.add_marker(pytest.mark.xdist_group("serial"))


@pytest.fixture(scope="session")
def nats_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EmbeddedNats]:
    """The session's server, with authentication on as everywhere (:mod:`shoal.auth`):
    the admin identity, whose seed file every test process uses through
    ``NATS_CREDS`` (as an operator's shell would), plus whatever identities a test
    adds with :func:`add_identity`. Permissions are for any single-token prefix."""
    store = tmp_path_factory.mktemp("jetstream")
    creds = CredentialStore(tmp_path_factory.mktemp("creds"))
    admin = creds.ensure("admin")
    previous = os.environ.get("NATS_CREDS")
    os.environ["NATS_CREDS"] = str(admin)
    try:
        with EmbeddedNats(store_dir=store, creds_dir=creds.directory, prefix="*") as server:
            yield server
    finally:
        if previous is None:
            os.environ.pop("NATS_CREDS", None)
        else:
            os.environ["NATS_CREDS"] = previous


def add_identity(server: EmbeddedNats, role: Role, subject: str = "", **kw: Any) -> str:
    """A new identity on the session server (reloaded to admit it); its seed file."""
    assert server.creds_dir is not None
    path = CredentialStore(server.creds_dir).ensure(role, subject, **kw)
    server.reload()
    return str(path)


@pytest.fixture(scope="module")
def nats_cluster(
    nats_server: EmbeddedNats, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[LocalCluster]:
    """A real 3-node JetStream cluster on 127.0.0.1 (one per test module: a cluster takes
    seconds to elect its meta leader), with the session server's identities, so the
    admin seed of ``NATS_CREDS`` works on every node. Ready when JetStream answers."""
    import asyncio

    import nats

    assert nats_server.creds_dir is not None
    cluster = LocalCluster(tmp_path_factory.mktemp("cluster"), creds_dir=nats_server.creds_dir, prefix="*")

    async def ready() -> None:
        nc = await nats.connect(servers=cluster.urls, nkeys_seed=os.environ["NATS_CREDS"])
        try:
            js = nc.jetstream(timeout=1.0)
            for _ in range(60):
                try:
                    await js.account_info()
                    return
                except Exception:
                    await asyncio.sleep(0.25)
            raise RuntimeError("the cluster's JetStream did not come up")
        finally:
            await nc.close()

    with cluster:
        asyncio.run(ready())
        yield cluster


@pytest.fixture
def nats_url(nats_server: EmbeddedNats) -> str:
    return nats_server.url


@pytest.fixture
def admin_creds() -> str:
    """The admin's seed file (see :func:`nats_server`)."""
    return os.environ["NATS_CREDS"]


@pytest.fixture
def prefix() -> str:
    return f"t{os.getpid()}x{next(_prefixes)}"


@pytest.fixture
async def bus(nats_url: str, prefix: str) -> AsyncIterator[Bus]:
    b = await Bus.connect(nats_url, prefix=prefix, creds=os.environ["NATS_CREDS"])
    try:
        yield b
    finally:
        await b.close()
