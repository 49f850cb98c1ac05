"""Shared fixtures: a real nats-server on a free port with a temporary store.

Layers: store dir -> server (one per test session) -> bus (one per test, with a
unique subject prefix and therefore unique streams, so tests never see each
other's events and could run in parallel).
"""

from __future__ import annotations

import itertools
import os
from collections.abc import AsyncIterator, Iterator

import pytest
from shoal.bus import Bus
from shoal.nats_server import EmbeddedNats

_prefixes = itertools.count(1)


@pytest.fixture(scope="session")
def nats_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EmbeddedNats]:
    store = tmp_path_factory.mktemp("jetstream")
    with EmbeddedNats(store_dir=store) as server:
        yield server


@pytest.fixture
def nats_url(nats_server: EmbeddedNats) -> str:
    return nats_server.url


@pytest.fixture
def prefix() -> str:
    return f"t{os.getpid()}x{next(_prefixes)}"


@pytest.fixture
async def bus(nats_url: str, prefix: str) -> AsyncIterator[Bus]:
    b = await Bus.connect(nats_url, prefix=prefix)
    try:
        yield b
    finally:
        await b.close()
