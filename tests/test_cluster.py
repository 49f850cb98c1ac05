"""shoal on a real 3-node NATS cluster (``nats_cluster``): replicated streams and buckets,
seed lists, and no acknowledged submission lost when the server leading the event stream
is killed (``kill -9``), restarted, or when every node is restarted in turn."""

from __future__ import annotations

import asyncio
import itertools
import os
import time
from collections.abc import AsyncIterator, Awaitable, Callable

import pytest
from shoal import admission, codec
from shoal import events as ev
from shoal.bus import Bus, NoServerError
from shoal.client import Client, CommandError, NoAdmissionError, _probe
from shoal.nats_server import EmbeddedNats, LocalCluster
from shoal.projection import Projection
from shoal_services.admission.service import AdmissionService

_ids = itertools.count(1)


async def eventually(check: Callable[[], Awaitable[bool]], timeout_s: float = 30.0, what: str = "") -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            if await check():
                return
        except Exception:
            if time.monotonic() > deadline:
                raise
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout_s}s: {what}")
        await asyncio.sleep(0.1)


async def connect(cluster: LocalCluster, prefix: str, **kw: object) -> Bus:
    return await Bus.connect(cluster.url, prefix=prefix, creds=os.environ["NATS_CREDS"], **kw)  # type: ignore[arg-type]


async def test_streams_buckets_and_snapshots_get_three_replicas_on_a_three_node_cluster(
    nats_cluster: LocalCluster, prefix: str
) -> None:
    bus = await connect(nats_cluster, prefix)
    try:
        assert bus.replicas == 3
        for stream in (
            bus.names.events_stream,
            bus.names.ctl_stream,
            bus.names.dlq_stream,
            bus.names.beats_stream,
        ):
            info = await bus.js.stream_info(stream)
            assert info.config.num_replicas == 3, stream
            assert info.cluster is not None and len(info.cluster.replicas or []) == 2
        lease = await bus.lease("allocator", "me", ttl_s=2.0)
        assert await lease.try_acquire()
        await bus.save_snapshot("s", 7, b"state")
        assert (await bus.load_snapshot("s")) is not None
        kv_streams = [s async for s in _stream_names(bus) if s.startswith(("KV_", "OBJ_"))]
        mine = [s for s in kv_streams if prefix.upper() in s.upper()]
        assert len(mine) == 3, kv_streams  # the lease, the sidecars' rendezvous, the snapshots
        for name in mine:
            assert (await bus.js.stream_info(name)).config.num_replicas == 3, name
    finally:
        await bus.close()


async def _stream_names(bus: Bus) -> AsyncIterator[str]:
    for info in await bus.js.streams_info():
        yield info.config.name


async def test_a_single_server_gets_one_replica(bus: Bus) -> None:
    assert bus.replicas == 1
    assert (await bus.js.stream_info(bus.names.events_stream)).config.num_replicas == 1


async def test_declare_never_scales_a_stream_down(nats_cluster: LocalCluster, prefix: str) -> None:
    admin = await connect(nats_cluster, prefix)  # R3
    try:
        low = await connect(nats_cluster, prefix, replicas=1)  # e.g. SHOAL_REPLICAS=1 by mistake
        await low.close()
        assert (await admin.js.stream_info(admin.names.events_stream)).config.num_replicas == 3
    finally:
        await admin.close()


async def test_a_later_start_raises_buckets_made_with_fewer_replicas(
    nats_cluster: LocalCluster, prefix: str
) -> None:
    """A first start that saw fewer servers (a node down: ``connect_urls`` lists two, so
    one replica) makes its streams, buckets and snapshot store with one replica; the
    admin's next start on the whole cluster (its declare, nothing else) raises them to
    three."""
    low = await connect(nats_cluster, prefix, replicas=1)
    try:
        await low.lease("allocator", "me", ttl_s=2.0)
        await low.save_snapshot("s", 7, b"state")
    finally:
        await low.close()
    full = await connect(nats_cluster, prefix)
    try:
        assert (await full.load_snapshot("s")) is not None
        n = full.names
        # Named, not listed: a stream list leaves out streams whose peers are changing.
        for name in (
            n.events_stream,
            n.beats_stream,
            f"KV_{n.lease_bucket}",
            f"KV_{n.train_meta_bucket}",
            f"OBJ_{n.snapshot_bucket}",
        ):
            assert (await full.js.stream_info(name)).config.num_replicas == 3, name
    finally:
        await full.close()


async def test_a_seed_list_whose_first_server_is_down_connects(
    nats_cluster: LocalCluster, nats_server: EmbeddedNats, prefix: str
) -> None:
    dead = "nats://127.0.0.1:1"
    seeds = f"{dead}, {nats_cluster.urls[1]}"
    await _probe(seeds, timeout_s=2.0)
    with pytest.raises(NoServerError, match="no NATS server reachable"):
        await _probe(f"{dead},nats://127.0.0.1:2", timeout_s=2.0)
    client = await Client.connect(seeds, prefix, creds=os.environ["NATS_CREDS"])
    try:
        assert client.bus.nc.is_connected
    finally:
        await client.close()


class Load:
    """Submissions at a steady pace; records the job id of every accepted reply."""

    def __init__(self, client: Client) -> None:
        self.client = client
        self.accepted: list[str] = []
        self.failed = 0
        self.stop = asyncio.Event()

    async def run(self) -> None:
        while not self.stop.is_set():
            job_id = f"j{next(_ids)}"
            try:
                reply = await self.client.submit_command({"user": "alice", "total_iterations": 10}, job_id)
            except (NoAdmissionError, CommandError, TimeoutError):
                self.failed += 1
                continue
            self.accepted.append(reply.id)
            await asyncio.sleep(0.01)

    async def accepted_more(self, n: int, timeout_s: float = 30.0) -> None:
        target = len(self.accepted) + n

        async def check() -> bool:
            return len(self.accepted) >= target

        await eventually(check, timeout_s, f"{n} more accepted submissions")


async def stream_leader(bus: Bus) -> str:
    info = await bus.js.stream_info(bus.names.events_stream)
    assert info.cluster is not None and info.cluster.leader
    return info.cluster.leader


async def all_current(bus: Bus) -> bool:
    info = await bus.js.stream_info(bus.names.events_stream)
    assert info.cluster is not None
    peers = info.cluster.replicas or []
    return len(peers) == 2 and all(p.current and not p.offline for p in peers)


async def assert_each_accepted_once(bus: Bus, accepted: list[str]) -> None:
    submitted = [
        e.event.job_id for _, e in [x async for x in bus.replay()] if isinstance(e.event, ev.JobSubmitted)
    ]
    assert len(submitted) == len(set(submitted)), "a submission landed twice"
    missing = set(accepted) - set(submitted)
    assert not missing, f"{len(missing)} acknowledged submissions lost: {sorted(missing)[:5]}"


async def run_admission(
    cluster: LocalCluster, prefix: str, body: Callable[[Bus, Load], Awaitable[None]]
) -> None:
    bus = await connect(cluster, prefix)
    client_bus = await connect(cluster, prefix, declare=False)
    await bus.publish(codec.wrap(ev.UserRegistered(user="alice", tickets=100), at=time.time()))
    projection = Projection(bus)
    await projection.start()
    await projection.wait_ready()
    svc = AdmissionService(bus, projection, admission.Limits(enforce_users=True))
    await svc.start()
    load = Load(Client(client_bus, timeout_s=3.0))
    task = asyncio.create_task(load.run())
    try:
        await load.accepted_more(20)
        await body(bus, load)
        await load.accepted_more(20)
    finally:
        load.stop.set()
        await task
        await svc.stop()
        await projection.stop()
    try:
        await eventually(lambda: all_current(bus), 30, "every replica current")
        await assert_each_accepted_once(bus, load.accepted)
    finally:
        await client_bus.close()
        await bus.close()


@pytest.mark.slow  # the default run kills the leader through shoal up (tests/services/test_cluster_up.py)
async def test_killing_the_event_stream_leader_loses_no_acknowledged_submission(
    nats_cluster: LocalCluster, prefix: str
) -> None:
    async def kill_leader(bus: Bus, load: Load) -> None:
        victim = nats_cluster.index_of(await stream_leader(bus))
        nats_cluster.kill(victim)
        try:
            await load.accepted_more(20)  # submissions resume on the two others
            assert (await stream_leader(bus)) != nats_cluster.server_name(victim)
        finally:
            nats_cluster.restart(victim)
        await eventually(lambda: all_current(bus), 30, "the restarted node caught up")

    await run_admission(nats_cluster, prefix, kill_leader)


@pytest.mark.slow
async def test_a_rolling_restart_of_all_three_loses_no_acknowledged_submission(
    nats_cluster: LocalCluster, prefix: str
) -> None:
    async def rolling(bus: Bus, load: Load) -> None:
        for i in range(3):
            nats_cluster.kill(i)
            await load.accepted_more(10)
            nats_cluster.restart(i)
            await eventually(lambda: all_current(bus), 30, f"node {i + 1} caught up")
            await load.accepted_more(10)

    await run_admission(nats_cluster, prefix, rolling)
