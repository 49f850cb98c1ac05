"""Start-up from the cluster snapshot plus the tail, with real ``shoal run`` processes.

The leading allocator writes the cluster snapshot (``shoal.projection.CLUSTER_SNAPSHOT``);
admission, the placer, the trader, a node daemon and a second allocator started with
``shoal run`` then fold only the tail after it (their ``projection_ready`` log line says
how many messages they replayed) and reach the digest of a full fold of the log up to
the same sequence. A corrupt snapshot is ignored with a warning and the service replays
everything. The snapshot checks themselves are pure (first tests).
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec
import pytest
from shoal import codec
from shoal import events as ev
from shoal import state as st
from shoal.auth import CredentialStore
from shoal.bus import Bus, Snapshot
from shoal.clock import WallClock
from shoal.nats_server import EmbeddedNats
from shoal.projection import CLUSTER_SNAPSHOT, SNAPSHOT_SCHEMA, check_snapshot

from tests.conftest import add_identity
from tests.services.test_faults import Children, service_env

pytestmark = pytest.mark.integration

HISTORY = 3_000
"""Heartbeats in the log before the snapshot (most of an idle cluster's log)."""
TAIL = 40


def _snap(
    state: st.ClusterState, *, seq: int = 5, schema: int = SNAPSHOT_SCHEMA, digest: str = ""
) -> Snapshot:
    return Snapshot(
        name=CLUSTER_SNAPSHOT,
        seq=seq,
        state=st.encode_state(state),
        digest=digest or st.digest(state),
        schema=schema,
    )


def test_check_snapshot_accepts_only_a_sound_snapshot() -> None:
    state = st.ClusterState(shares_epoch=3)
    ok, reason = check_snapshot(_snap(state), stream_last_seq=5)
    assert ok is not None and st.digest(ok) == st.digest(state) and reason == ""
    bad = [
        (_snap(state, schema=SNAPSHOT_SCHEMA + 1), "newer"),
        (_snap(state, digest="0" * 64), "digest mismatch"),
        (_snap(state, seq=6), "past the stream"),
        (Snapshot(name="x", seq=1, state=b"\xc1junk", digest="ab"), "does not decode"),
        (Snapshot(name="x", seq=1, state=st.encode_state(state)), "no digest"),
    ]
    for snap, why in bad:
        got, reason = check_snapshot(snap, stream_last_seq=5)
        assert got is None and why in reason, (why, reason)


# -- real processes -------------------------------------------------------------------


@pytest.fixture
def kids(tmp_path: Path) -> Iterator[Children]:
    k = Children(tmp_path)
    try:
        yield k
    finally:
        k.stop_all()


def _history(n: int) -> list[ev.Envelope]:
    """Two nodes, a user and a job, then ``n`` heartbeats stamped now (the nodes stay up)."""
    now = time.time()
    out = [
        codec.wrap(
            ev.NodeRegistered(
                node_id=f"n{i}", gpus=tuple(ev.GpuInfo(index=g, gpu_type="V100") for g in range(4))
            ),
            at=now,
        )
        for i in range(2)
    ]
    out.append(codec.wrap(ev.UserRegistered(user="u", tickets=100), at=now))
    out.append(
        codec.wrap(
            ev.JobSubmitted(
                job_id="j0", spec=ev.JobSpec(user="u", model="resnet50", max_gpus=2, total_iterations=10**9)
            ),
            at=now,
        )
    )
    out += [codec.wrap(ev.NodeHeartbeat(node_id=f"n{i % 2}"), at=now + i * 1e-4) for i in range(n)]
    return out


def _lines(kids: Children, name: str) -> list[dict[str, Any]]:
    out = []
    for line in (kids.log_dir / f"{name}.log").read_text(errors="replace").splitlines():
        if line.startswith("{"):
            try:
                out.append(json.loads(line))
            except ValueError:
                continue
    return out


async def _logged(kids: Children, name: str, event: str, timeout_s: float = 90.0) -> dict[str, Any]:
    deadline = time.monotonic() + timeout_s
    while True:
        found = [r for r in _lines(kids, name) if r.get("event") == event]
        if found:
            return found[0]
        proc = kids.procs[name]
        assert proc.poll() is None, f"{name} exited {proc.returncode}: {kids.log(name)}"
        assert time.monotonic() < deadline, f"{name} never logged {event}: {kids.log(name)}"
        await asyncio.sleep(0.1)


async def _digest_up_to(bus: Bus, seq: int) -> str:
    state = st.ClusterState()
    async for batch in bus.replay_batches(start_seq=1):
        for s, env in batch:
            if s > seq:
                return st.digest(state)
            st.apply(state, env)
        if batch.last_seq >= seq:
            break
    return st.digest(state)


async def test_every_service_starts_from_the_snapshot_and_folds_only_the_tail(
    bus: Bus, nats_server: EmbeddedNats, nats_url: str, prefix: str, tmp_path: Path, kids: Children
) -> None:
    env = service_env(
        nats_url, prefix, WallClock(), tmp_path, snapshot_every="1", node_timeout_s="3600", policy="fifo"
    )
    await bus.publish_many(_history(HISTORY), window=1024)
    # The leading allocator, caught up, writes the cluster snapshot.
    kids.start("writer", "allocator", env)
    deadline = time.monotonic() + 40
    while (snap := await bus.load_snapshot(CLUSTER_SNAPSHOT)) is None or snap.seq < HISTORY:
        assert time.monotonic() < deadline, kids.log("writer")
        await asyncio.sleep(0.1)
    kids.procs["writer"].terminate()
    kids.procs["writer"].wait(20)
    snap = await bus.load_snapshot(CLUSTER_SNAPSHOT)
    assert snap is not None
    # A tail after it.
    await bus.publish_many(_history(TAIL)[4:])
    services = {
        "admission": {},
        "placer": {},
        "trader": {},
        "allocator": {},
        "node-daemon": {"SHOAL_NODE_ID": "n9", "SHOAL_FAKE_GPUS": "2", "SHOAL_SIDECAR_SPARES": "0"},
        # The auth callout's service folds the log too (which job runs where); it
        # authenticates as itself, with the callout issuer's seed beside its own.
        "authorizer": {"NATS_CREDS": add_identity(nats_server, "authorizer")},
    }
    assert nats_server.creds_dir is not None
    CredentialStore(nats_server.creds_dir).ensure_issuer()
    for name, more in services.items():
        kids.start(name, name, {**env, **more})
    for name in services:
        ready = await _logged(kids, name, "projection_ready")
        # This snapshot, or a newer one the second allocator wrote meanwhile.
        assert ready["snapshot_seq"] >= snap.seq, (name, ready)
        # Only the tail (plus what the services appended meanwhile), never the history.
        assert ready["replayed"] == ready["last_seq"] - ready["snapshot_seq"], (name, ready)
        assert ready["replayed"] < TAIL + 50, (name, ready)
        assert ready["digest"] == await _digest_up_to(bus, ready["last_seq"]), name


async def test_a_corrupt_snapshot_is_ignored_and_the_service_replays(
    bus: Bus, nats_url: str, prefix: str, tmp_path: Path, kids: Children
) -> None:
    env = service_env(nats_url, prefix, WallClock(), tmp_path)
    await bus.publish_many(_history(200))
    last = await bus.last_seq()
    store = await bus._snapshot_store()
    # A snapshot whose state does not match its digest (bytes flipped in storage).
    good = _snap(st.ClusterState(shares_epoch=99), seq=last)
    await store.put(CLUSTER_SNAPSHOT, msgspec.msgpack.encode(msgspec.structs.replace(good, digest="f" * 64)))
    kids.start("admission", "admission", env)
    ignored = await _logged(kids, "admission", "snapshot_ignored")
    assert "digest mismatch" in ignored["reason"]
    ready = await _logged(kids, "admission", "projection_ready")
    assert ready["snapshot_seq"] == 0 and ready["replayed"] == ready["last_seq"] >= last
    assert ready["digest"] == await _digest_up_to(bus, ready["last_seq"])
    # Bytes that are no snapshot at all.
    await store.put(CLUSTER_SNAPSHOT, b"\x00garbage")
    kids.start("admission2", "admission", env)
    ignored = await _logged(kids, "admission2", "snapshot_ignored")
    assert "unreadable" in ignored["reason"]
    ready = await _logged(kids, "admission2", "projection_ready")
    assert ready["snapshot_seq"] == 0 and ready["replayed"] == ready["last_seq"]


async def test_a_node_identity_reads_the_snapshot(bus: Bus, nats_server: Any, prefix: str) -> None:
    """Node daemons run as role ``node``: read-only JetStream, and still start from the snapshot."""
    from tests.conftest import add_identity

    await bus.publish_many(_history(10))
    state = st.ClusterState(shares_epoch=7)
    await bus.save_snapshot(
        CLUSTER_SNAPSHOT, 5, st.encode_state(state), digest=st.digest(state), schema=SNAPSHOT_SCHEMA
    )
    seed = add_identity(nats_server, "node", "nsnap")
    node_bus = await Bus.connect(nats_server.url, prefix=prefix, creds=seed)
    try:
        snap = await node_bus.load_snapshot(CLUSTER_SNAPSHOT)
        assert snap is not None and snap.seq == 5
        got, _ = check_snapshot(snap, stream_last_seq=await node_bus.last_seq())
        assert got is not None and got.shares_epoch == 7
    finally:
        await node_bus.close()
