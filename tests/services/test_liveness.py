"""Node liveness with real processes: an installation started as a user starts it
(``shoal up``), with a short node timeout.

1. A flood of valid heartbeats for one node (published with plain nats-py, as an
   attacker with a node's credentials would) is refused by the server past eight stored
   heartbeats, and never reaches the log: submissions during and after it are answered
   promptly, no other node is declared lost, the flooded node comes back by itself,
   the allocator keeps its lease, and a job submitted after it runs on both nodes.
2. The allocator process stopped (SIGSTOP) for longer than the node timeout, then
   continued: no node stays lost, and a job submitted afterwards runs.
3. A node daemon stopped (SIGSTOP) past the timeout is declared lost; continued, it
   comes back without a restart and the allocator and placer use its GPUs again.

Every wait is a condition with a timeout, generous because the machine may be small
and busy.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import nats
import nats.errors
import pytest
from shoal import codec
from shoal import events as ev
from shoal import state as st
from shoal.bus import BEATS_PER_NODE, Bus
from shoal.client import Client, NoAdmissionError
from shoal.commands.run import CLI_ARGV as CLI
from shoal.projection import Projection
from shoal.settings import default_node_id

from tests.services.test_up import descendants, wait_line

pytestmark = pytest.mark.integration

NODE_TIMEOUT_S = 2.0
"""Wall seconds without a heartbeat after which a node is lost (``SHOAL_NODE_TIMEOUT_S``)."""
HEARTBEAT_S = 0.25
TIME_SCALE = 20.0
"""The installation's ``--time-scale`` (see :func:`shoal_up`)."""
FLOOD = 50_000
"""Heartbeats of the flood (the attack was 200,000 in 4 s)."""


class Up:
    """A ``shoal up`` process: 2 emulated nodes of 2 GPUs, FIFO, time scale 20."""

    def __init__(self, proc: subprocess.Popen[str], url: str, creds: Path) -> None:
        self.proc = proc
        self.url = url
        self.creds = creds
        """The installation's credentials directory (``<state dir>/creds``)."""

    def admin(self) -> dict[str, Any]:
        """Keyword arguments that connect as the admin (its seed file, where the
        installation authenticates connections)."""
        path = self.creds / "admin.nk"
        return {"creds": str(path)} if path.exists() else {}

    def pid_of(self, *argv: str) -> int:
        """The pid of the one child whose command line contains ``argv`` in order."""
        needle = "\0".join(argv).encode()
        found = []
        for pid in descendants(self.proc.pid):
            try:
                cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
            except OSError:
                continue
            if needle in cmdline and b"trainer_sidecar" not in cmdline:
                found.append(pid)
        assert len(found) == 1, (argv, found)
        return found[0]


@contextlib.asynccontextmanager
async def shoal_up(
    tmp_path: Path, nodes: int = 2, policy: str = "fifo", *, flags: tuple[str, ...] = (), **settings: str
) -> AsyncIterator[Up]:
    """`shoal up` as a user starts it (``nodes`` emulated nodes of 2 GPUs, ``policy``
    (FIFO by default), time scale 20, no catalog, more ``flags``, ``settings`` as
    ``SHOAL_*`` variables); on exit any process a test left stopped is continued and the
    installation is stopped (SIGINT, then SIGKILL)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SHOAL_", "NATS_"))}
    env.update(SHOAL_STATE_DIR=str(tmp_path / "state"), SHOAL_CATALOG="", **settings)
    argv = [
        *CLI,
        "up",
        "--nodes",
        str(nodes),
        "--gpus-per-node",
        "2",
        "--time-scale",
        "20",
        "--policy",
        policy,
        *flags,
    ]
    proc = subprocess.Popen(
        argv,
        stdout=subprocess.PIPE,
        stderr=(tmp_path / "up.err").open("w"),
        text=True,
        env=env,
        start_new_session=True,
    )
    try:
        url = await asyncio.to_thread(lambda: wait_line(proc, "NATS: ", 30).split(" ", 1)[1].strip())
        await asyncio.to_thread(wait_line, proc, "running", 90)
        yield Up(proc, url, tmp_path / "state" / "creds")
    finally:
        for pid in descendants(proc.pid):  # a test may leave one stopped
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGINT)
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()


@pytest.fixture
async def up(tmp_path: Path) -> AsyncIterator[Up]:
    settings = {"SHOAL_NODE_TIMEOUT_S": repr(NODE_TIMEOUT_S), "SHOAL_HEARTBEAT_S": repr(HEARTBEAT_S)}
    async with shoal_up(tmp_path, **settings) as installation:
        yield installation


async def wait_until(predicate: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for: {what}"
        await asyncio.sleep(0.05)


async def watch_beats(bus: Bus, beat_at: dict[str, float]) -> Any:
    """Subscribe to every node's heartbeats as published (they never reach the log) and
    keep the stamp of each node's newest in ``beat_at``; the subscription, flushed."""

    async def on_beat(msg: Any) -> None:
        with contextlib.suppress(codec.DecodeFailure):
            env = codec.decode(msg.data)
            if isinstance(env.event, ev.NodeHeartbeat):
                node = env.event.node_id
                beat_at[node] = max(beat_at.get(node, env.at), env.at)

    sub = await bus.nc.subscribe(bus.names.beat("*"), cb=on_beat)
    await bus.nc.flush()
    return sub


class Watch:
    """The installation's log as it happens: the folded state, every ``NodeLost`` (with
    its virtual instant in :attr:`lost_at`), and the stamp of each node's newest
    heartbeat seen on the beats subjects (:attr:`beat_at`)."""

    def __init__(self, bus: Bus) -> None:
        self.bus = bus
        self.lost: list[tuple[float, str]] = []
        self.lost_at: list[float] = []
        self.beat_at: dict[str, float] = {}
        self.projection = Projection(bus, listeners=[self._on_event])
        self._beats: Any = None

    async def start(self) -> None:
        self._beats = await watch_beats(self.bus, self.beat_at)
        await self.projection.start()

    async def stop(self) -> None:
        await self.projection.stop()
        if self._beats is not None:
            await self._beats.unsubscribe()

    def _on_event(self, seq: int, env: ev.Envelope, state: st.ClusterState) -> None:
        if isinstance(env.event, ev.NodeLost):
            self.lost.append((time.monotonic(), env.event.node_id))
            self.lost_at.append(env.at)

    @property
    def state(self) -> st.ClusterState:
        return self.projection.state

    def nodes_up(self) -> set[str]:
        return {n for n, node in self.state.nodes.items() if node.status == st.NODE_UP}


@pytest.fixture
async def watch(up: Up) -> AsyncIterator[tuple[Bus, Watch]]:
    bus = await Bus.connect(up.url, prefix="shoal", **up.admin())
    w = Watch(bus)
    await w.start()
    try:
        await wait_until(lambda: w.nodes_up() == {"node0", "node1"}, 30, "both nodes registered")
        yield bus, w
    finally:
        await w.stop()
        await bus.close()


async def run_job(up: Up, job_id: str, gpus: int, timeout_s: float = 60) -> set[str]:
    """Submit a job of ``gpus`` GPUs, wait for it to complete; the nodes it ran on."""
    placed_on: set[str] = set()
    spec = ev.JobSpec(user="alice", min_gpus=gpus, max_gpus=gpus, requested_gpus=gpus, total_iterations=40)
    async with await Client.connect(up.url, "shoal", **up.admin()) as client:
        deadline = time.monotonic() + 30
        while True:
            try:
                await client.submit(spec, job_id=job_id)
                break
            except NoAdmissionError as exc:
                # Just started: admission may not listen yet (nobody got the command).
                if not isinstance(exc.__cause__, nats.errors.NoRespondersError):
                    raise
                assert time.monotonic() < deadline, "admission never answered"
                await asyncio.sleep(0.2)

        async def follow() -> str:
            last = ""
            async for env in client.job_events(job_id):
                last = env.type
                if isinstance(env.event, ev.ReconfigurationCompleted):
                    placed_on.update(g.node_id for g in env.event.gpus)
            return last

        assert await asyncio.wait_for(follow(), timeout_s) == "job.completed"
    return placed_on


async def newest_beat(bus: Bus, node_id: str) -> float:
    """The stamp of ``node_id``'s newest stored heartbeat (waiting out the moment between
    one expiring and the next being stored)."""
    deadline = time.monotonic() + 10
    while (at := (await bus.latest_beats([node_id])).get(node_id)) is None:
        assert time.monotonic() < deadline, f"no heartbeat of {node_id} stored"
        await asyncio.sleep(0.05)
    return at


async def lease_holder(bus: Bus) -> str | None:
    lease = await bus.lease("allocator", "observer", ttl_s=3.0)
    return await lease.holder_now()


# -- 1. a heartbeat flood ------------------------------------------------------------------


async def _flood(up: Up, bus: Bus, w: Watch, flood: int) -> None:
    """``flood`` valid heartbeats for node0 with node0's own credentials (a node taken
    over), as fast as plain nats-py publishes them, on the only heartbeat subject the
    server lets it use: its key in the beats stream. The server stores at most eight of
    node0's heartbeats at a time (the flood's carry no TTL, so each stays the stream's
    ``max_age``) and refuses the rest unwritten. A submission sent while the flood goes
    on, and one right after it, are answered promptly; the log does not grow by the
    flood; the lease stays put and node1 is never declared lost.

    node0's own daemon's heartbeats are refused while the flood holds node0's eight
    places, so node0 may be declared lost: a node's identity can silence its own node,
    as by stopping its heartbeats (``docs/security.md``). It comes back by itself, stays
    up, and a job needing both nodes runs on both."""
    allocator = up.pid_of("run", "allocator")
    holder = f"allocator-{default_node_id()}-{allocator}"
    deadline = time.monotonic() + 30
    while await lease_holder(bus) != holder:
        assert time.monotonic() < deadline, "the allocator never took its lease"
        await asyncio.sleep(0.1)
    assert await run_job(up, "before", 2)

    seed = up.creds / "node-node0.nk"  # node0's own identity (shoal.auth)
    attacker = await nats.connect(up.url, nkeys_seed=str(seed), inbox_prefix="_INBOX.node-node0")
    subject = bus.names.beat("node0")
    before = await bus.last_seq()
    beats_before, beats_t0 = await bus.last_seq(bus.names.beats_stream), time.monotonic()
    node0_daemon = up.pid_of("run", "node-daemon", "--node-id", "node0")
    sent = 0

    # Valid heartbeats carry the installation's (virtual) time: the stamps go on from
    # node0's newest one at the time scale. (Stamps from the past would mask node0's own
    # heartbeats, which only node0's identity can do, and it re-registers at once.)
    origin, t_origin = (await newest_beat(bus, "node0")), time.monotonic()

    async def attack() -> None:
        nonlocal sent
        for i in range(flood):
            at = origin + TIME_SCALE * (time.monotonic() - t_origin)
            beat = codec.wrap(ev.NodeHeartbeat(node_id="node0", seq=10**9 + i), at=at)
            await attacker.publish(subject, codec.encode(beat))
            sent = i + 1
            if i % 1000 == 0:
                await asyncio.sleep(0)  # let the submission below run meanwhile
        await attacker.flush()

    spec = ev.JobSpec(user="alice", min_gpus=1, max_gpus=1, requested_gpus=1, total_iterations=10)
    answered: dict[str, float] = {}
    started = time.monotonic()
    try:
        async with await Client.connect(up.url, "shoal", **up.admin()) as client:
            flooding = asyncio.create_task(attack())
            await wait_until(lambda: sent >= flood // 10, 60, "a tenth of the flood sent")
            t0 = time.monotonic()
            await client.submit(spec, job_id="during-flood")
            answered["during"] = time.monotonic() - t0
            during_sent = sent
            await flooding
            t0 = time.monotonic()
            await client.submit(spec, job_id="after-flood")
            answered["after"] = time.monotonic() - t0
    finally:
        await attacker.close()
    flood_s = time.monotonic() - started
    print(
        f"flood of {flood} in {flood_s:.1f}s; submission answered in {answered} (during: at {during_sent} sent)"
    )
    assert during_sent < flood, "the submission was not answered while the flood went on"
    assert all(t < 5.0 for t in answered.values()), f"a submission waited: {answered}"
    holders = set()
    # Well past the node timeout after the flood: the lease stays with the same allocator
    # process and no node is declared lost.
    until = time.monotonic() + 3 * NODE_TIMEOUT_S
    while time.monotonic() < until:
        holders.add(await lease_holder(bus))
        await asyncio.sleep(0.2)
    seq = await bus.last_seq()
    assert seq - before < 200, f"the flood reached the log: {seq - before} events"
    # Rate-limited by the server: at most eight heartbeats a second per node were written
    # (node0's subject, shared by the flood and node0's daemon, and node1's).
    written = await bus.last_seq(bus.names.beats_stream) - beats_before
    window_s = time.monotonic() - beats_t0
    print(f"beats stream: {written} heartbeats written in {window_s:.1f}s (flood and after)")
    assert written <= 2 * BEATS_PER_NODE * (window_s + 2), f"{written} heartbeats written in {window_s:.1f}s"
    beats = await bus.js.stream_info(bus.names.beats_stream)
    assert beats.state.messages <= 2 * BEATS_PER_NODE, (
        "the beats stream keeps at most eight heartbeats per node"
    )
    await w.projection.wait_for(seq, timeout_s=120)
    assert {n for _, n in w.lost} <= {"node0"}, f"a node other than the flooder's declared lost: {w.lost}"
    assert holders == {holder}, f"the allocator lost its lease: {holders}"
    assert up.pid_of("run", "allocator") == allocator, "the allocator was restarted"
    # node0 is back by itself (its daemon was not restarted) and stays up; it keeps
    # scheduling: a job needing both nodes runs on both.
    await wait_until(lambda: w.nodes_up() == {"node0", "node1"}, 30, "node0 back after the flood")
    assert up.pid_of("run", "node-daemon", "--node-id", "node0") == node0_daemon
    assert await run_job(up, "after", 4) == {"node0", "node1"}
    settled = len(w.lost)
    until = time.monotonic() + 3 * NODE_TIMEOUT_S
    while time.monotonic() < until:
        await asyncio.sleep(0.2)
    assert w.lost[settled:] == [], f"a node declared lost after the flood was over: {w.lost[settled:]}"
    assert w.nodes_up() == {"node0", "node1"}


async def test_heartbeat_flood_marks_no_live_node_lost(up: Up, watch: tuple[Bus, Watch]) -> None:
    bus, w = watch
    await _flood(up, bus, w, FLOOD)


@pytest.mark.slow
async def test_heartbeat_flood_of_the_issue_size(up: Up, watch: tuple[Bus, Watch]) -> None:
    """The attack of issue 20 at its size: 200,000 heartbeats."""
    bus, w = watch
    await _flood(up, bus, w, 200_000)


# -- 2. a lagging allocator -----------------------------------------------------------------


async def test_stopped_allocator_leaves_no_live_node_lost(up: Up, watch: tuple[Bus, Watch]) -> None:
    bus, w = watch
    allocator = up.pid_of("run", "allocator")
    assert await run_job(up, "before", 2)
    os.kill(allocator, signal.SIGSTOP)
    try:
        # Past the node timeout while the nodes go on heartbeating (to the beats stream).
        first = await newest_beat(bus, "node0")
        stopped = time.monotonic()
        await wait_until(lambda: time.monotonic() - stopped > 2.5 * NODE_TIMEOUT_S, 30, "time passes")
        assert await newest_beat(bus, "node0") > first, "the nodes heartbeat meanwhile"
    finally:
        os.kill(allocator, signal.SIGCONT)
    # Whatever the allocator declares once it runs again, no node stays lost, and a job
    # needing both nodes runs on both.
    continued = time.monotonic()
    await wait_until(lambda: time.monotonic() - continued > 2 * NODE_TIMEOUT_S, 30, "time passes")
    await wait_until(lambda: w.nodes_up() == {"node0", "node1"}, 30, "both nodes up")
    assert await run_job(up, "after", 4) == {"node0", "node1"}
    assert w.nodes_up() == {"node0", "node1"}


# -- 3. a node that really stops heartbeating -----------------------------------------------


async def test_stopped_node_is_lost_and_comes_back_when_continued(up: Up, watch: tuple[Bus, Watch]) -> None:
    _bus, w = watch
    daemon = up.pid_of("run", "node-daemon", "--node-id", "node1")
    await wait_until(lambda: "node1" in w.beat_at, 10, "a heartbeat of node1 seen")
    os.kill(daemon, signal.SIGSTOP)
    try:
        stopped = time.monotonic()
        await wait_until(lambda: "node1" in {n for _, n in w.lost}, 10 * NODE_TIMEOUT_S, "node1 lost")
        lost_after = w.lost[0][0] - stopped
        assert w.lost[0][1] == "node1" and len({n for _, n in w.lost}) == 1, w.lost
        assert w.state.nodes["node1"].status == st.NODE_LOST
        # The survivor still runs work meanwhile.
        assert await run_job(up, "meanwhile", 2) == {"node0"}
    finally:
        os.kill(daemon, signal.SIGCONT)
    # Overdue is judged on the shared clock the heartbeats are stamped with: the
    # NodeLost comes at least a timeout (in virtual seconds) after node1's newest
    # heartbeat. In wall time that is up to a heartbeat interval less than the timeout
    # after the SIGSTOP (more if the daemon lagged before it), and the clock may have
    # stood still meanwhile; the wall check only rules out a premature declaration.
    last_beat = w.beat_at["node1"]
    assert w.lost_at[0] - last_beat >= NODE_TIMEOUT_S * TIME_SCALE, (
        "declared lost before its heartbeats were overdue",
        w.lost_at[0],
        last_beat,
    )
    assert lost_after >= NODE_TIMEOUT_S / 2, ("declared lost too soon after the stop", lost_after)
    await wait_until(lambda: w.nodes_up() == {"node0", "node1"}, 30, "node1 back")
    assert up.pid_of("run", "node-daemon", "--node-id", "node1") == daemon, "the node daemon was restarted"
    # Its GPUs are used again: a job needing both nodes runs on both.
    assert await run_job(up, "after", 4) == {"node0", "node1"}
    assert w.state.nodes["node1"].gpus and len(w.state.nodes["node1"].gpus) == 2
