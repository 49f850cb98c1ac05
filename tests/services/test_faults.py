"""Faults with real processes: a node daemon and an allocator killed with ``kill -9``.

1. A node daemon dies (SIGKILL): the allocator declares it ``NodeLost`` once its
   heartbeats stop, the job it ran is given GPUs on the surviving node, every job still
   completes, and the dead daemon's sidecars do not outlive it (they stop on end of stdin).
2. The leading allocator dies (SIGKILL) in the middle of a burst of submissions: the
   standby takes over once the lease lapses (the lease is not released, so this is the
   TTL path), no share decision is lost or made twice, and the new leader's state is
   exactly the state folded from the log.

The killed processes are real ``shoal run …`` subprocesses; the survivors whose state
the test reads (allocator, placer, standby allocator) run in-process against the same
real nats-server. Every wait is a condition with a timeout, generous because the test
machine may be small and busy.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from shoal import codec
from shoal import events as ev
from shoal import state as st
from shoal.bus import Bus, fold_log
from shoal.clock import Clock, ScaledClock, WallClock
from shoal.commands.run import CLI_ARGV
from shoal.policies.fifo import FIFO
from shoal.settings import default_node_id
from shoal_services.allocator.service import AllocatorService
from shoal_services.placer.service import PlacerService

from tests.services.test_allocator_placer import events_of, wait_until
from tests.services.test_liveness import watch_beats

pytestmark = pytest.mark.integration


# -- processes ---------------------------------------------------------------------


def service_env(nats_url: str, prefix: str, clock: Clock, state_dir: Path, **more: str) -> dict[str, str]:
    """The environment of a ``shoal run`` child: our ``SHOAL_*``/``NATS_URL`` removed, the
    test's server, prefix and clock set, plus ``more`` (``SHOAL_`` is prepended)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("SHOAL_") and k != "NATS_URL"}
    env.update(
        SHOAL_NATS_URL=nats_url,
        SHOAL_PREFIX=prefix,
        SHOAL_STATE_DIR=str(state_dir),
        SHOAL_LOG_FORMAT="json",
        SHOAL_CATALOG="",
    )
    if isinstance(clock, ScaledClock):
        env.update(SHOAL_TIME_SCALE=repr(clock.scale), SHOAL_CLOCK_ORIGIN=repr(clock.origin))
    env.update({f"SHOAL_{k.upper()}": v for k, v in more.items()})
    return env


class Children:
    """``shoal run`` subprocesses, each logging to a file; all stopped at the end."""

    def __init__(self, log_dir: Path) -> None:
        self.log_dir = log_dir
        self.procs: dict[str, subprocess.Popen[bytes]] = {}

    def start(self, name: str, service: str, env: dict[str, str]) -> subprocess.Popen[bytes]:
        with open(self.log_dir / f"{name}.log", "wb") as out:
            proc = subprocess.Popen(
                [*CLI_ARGV, "run", service],
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        self.procs[name] = proc
        return proc

    def log(self, name: str) -> str:
        return (self.log_dir / f"{name}.log").read_text(errors="replace")[-4000:]

    def stop_all(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in self.procs.values():
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


@pytest.fixture
def children(tmp_path: Path) -> Iterator[Children]:
    kids = Children(tmp_path)
    try:
        yield kids
    finally:
        kids.stop_all()


def alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie does not)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def sidecars_of(pid: int) -> set[int]:
    """Live child processes of ``pid`` that are trainer sidecars (from /proc)."""
    out = set()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            cmdline = (entry / "cmdline").read_bytes()
        except OSError:
            continue
        if int(fields[1]) == pid and fields[0] != "Z" and b"trainer_sidecar" in cmdline:
            out.add(int(entry.name))
    return out


async def stop_services(stop: asyncio.Event, tasks: list[asyncio.Task[None]]) -> None:
    stop.set()
    await asyncio.wait_for(asyncio.gather(*tasks), 30)


# -- 1. a node daemon killed with kill -9 ---------------------------------------------

SCALE = 100.0
ITERATIONS = {"a": 1200, "b": 4800}
"""4 GPUs, linear curve (no catalog): 4 it/s, so "a" runs 300 virtual s = 3 wall s and
"b" 12 wall s, long enough to be still running when the node is declared lost."""
NODE_TIMEOUT_S = 2.0
"""Wall seconds without heartbeat before the allocator declares a node lost."""


async def test_killed_node_daemon_is_lost_and_its_job_moves_to_the_survivor(
    bus: Bus, nats_url: str, prefix: str, children: Children, tmp_path: Path
) -> None:
    clock = ScaledClock(SCALE)
    procs = {
        n: children.start(
            n,
            "node-daemon",
            service_env(
                nats_url,
                prefix,
                clock,
                tmp_path / "state",
                node_id=n,
                fake_gpus="4",
                gpu_type="V100",
                heartbeat_s="0.2",
                report_every_s="0.1",
            ),
        )
        for n in ("n0", "n1")
    }
    stop = asyncio.Event()
    beat_at: dict[str, float] = {}  # each node's newest heartbeat stamp
    beats = await watch_beats(bus, beat_at)
    alloc = AllocatorService(bus, FIFO(), holder="alloc", clock=clock, node_timeout_s=NODE_TIMEOUT_S)
    placer = PlacerService(bus, holder="placer", clock=clock)
    tasks = [asyncio.create_task(alloc.run(stop)), asyncio.create_task(placer.run(stop))]
    state = placer.projection.state
    try:
        await wait_until(lambda: {"n0", "n1"} <= set(placer.projection.state.nodes), timeout=30)
        state = placer.projection.state
        # FIFO, 4 GPUs each: "a" (older) and "b" get one node each.
        for j in ("a", "b"):
            spec = ev.JobSpec(
                user="u", min_gpus=4, max_gpus=4, requested_gpus=4, total_iterations=ITERATIONS[j]
            )
            await bus.publish(codec.wrap(ev.JobSubmitted(job_id=j, spec=spec), at=clock.now()))
        # Both run and report progress: their sidecars are up on both nodes.
        await wait_until(lambda: all(j in state.jobs and state.jobs[j].iteration > 0 for j in "ab"), 30)
        nodes_of_a = {g.node_id for g in state.jobs["a"].placement}
        assert len(nodes_of_a) == 1 and len(state.jobs["a"].placement) == 4
        victim = nodes_of_a.pop()
        survivor = next(n for n in ("n0", "n1") if n != victim)
        assert {g.node_id for g in state.jobs["b"].placement} == {survivor}
        await wait_until(lambda: sidecars_of(procs[victim].pid), timeout=10)
        orphans = sidecars_of(procs[victim].pid)
        await wait_until(lambda: victim in beat_at, timeout=10)

        procs[victim].send_signal(signal.SIGKILL)
        procs[victim].wait(timeout=10)
        killed_at = time.monotonic()
        before_loss = state.jobs["a"].iteration
        # The dead daemon's sidecars saw the end of their stdin and stopped.
        await wait_until(lambda: not any(alive(p) for p in orphans), timeout=15)

        await wait_until(lambda: state.nodes[victim].status == st.NODE_LOST, timeout=NODE_TIMEOUT_S + 15)
        lost_after = time.monotonic() - killed_at
        # The job of the dead node now runs on the survivor, and everything completes.
        await wait_until(
            lambda: (
                (
                    "a" in state.placed
                    and {g.node_id for g in state.jobs["a"].placement} == {survivor}
                    and state.jobs["a"].iteration > before_loss
                )
                or state.jobs["a"].status == st.COMPLETED
            ),
            timeout=30,
        )
        await wait_until(lambda: all(state.jobs[j].status == st.COMPLETED for j in "ab"), timeout=45)
        assert state.nodes[survivor].status == st.NODE_UP
        assert procs[survivor].poll() is None, children.log(survivor)
    finally:
        await stop_services(stop, tasks)
        await beats.unsubscribe()

    envelopes = [(seq, env) async for seq, env in bus.replay()]
    log = [(seq, env.event) for seq, env in envelopes]
    lost = [(seq, e) for seq, e in log if isinstance(e, ev.NodeLost)]
    # Overdue is judged on the heartbeats' own stamps (virtual seconds of the scaled
    # clock): the NodeLost comes a whole timeout after the victim's newest heartbeat,
    # which may be up to a heartbeat interval (0.2 s) before the kill, or more if the
    # daemon lagged. The wall check only rules out a premature declaration.
    lost_stamp = next(env.at for _, env in envelopes if isinstance(env.event, ev.NodeLost))
    assert lost_stamp - beat_at[victim] >= NODE_TIMEOUT_S * SCALE, (
        "declared lost before its heartbeats were overdue",
        lost_stamp,
        beat_at[victim],
    )
    assert lost_after >= NODE_TIMEOUT_S / 2, ("declared lost too soon after the kill", lost_after)
    assert lost and {e.node_id for _, e in lost} == {victim}, "only the dead node is lost"
    lost_seq = lost[0][0]
    after = [e for seq, e in log if seq > lost_seq]
    shares = next((e for e in after if isinstance(e, ev.SharesDecided)), None)
    assert shares is not None, "the allocator decided again once the node was lost"
    assert shares.trigger == "node_change" and shares.shares == {"a": 4}, "b yields to the older job"
    placements = [e for e in after if isinstance(e, ev.PlacementDecided)]
    moved = next((p for p in placements if p.epoch == shares.epoch), None)
    assert moved is not None, "the decision after the loss was placed"
    assert set(moved.placements) == {"a"}
    assert {g.node_id for g in moved.placements["a"]} == {survivor} and len(moved.placements["a"]) == 4
    # No placement after the loss uses a GPU of the dead node.
    for p in placements:
        assert all(g.node_id == survivor for gpus in p.placements.values() for g in gpus)
    completed = [e for _, e in log if isinstance(e, ev.JobCompleted)]
    assert sorted(e.job_id for e in completed) == ["a", "b"], "each job completes exactly once"
    assert all(e.iterations == ITERATIONS[e.job_id] for e in completed)
    decisions = [e for _, e in log if isinstance(e, ev.SharesDecided)]
    assert [d.epoch for d in decisions] == list(range(1, len(decisions) + 1))
    for pid in orphans:
        assert not alive(pid)


# -- 2. the leading allocator killed with kill -9 during a burst -------------------------

LEASE_TTL_S = 1.0
TAKEOVER_SLACK_S = 3.0
"""Beyond the TTL: the standby's retry period (TTL/3), KV expiry and a busy machine."""
BURST = 80
"""Jobs of the burst, one every 30 ms: the kill comes after about a fifth of them, and
the rest keep arriving while there is no leader and after the standby took over."""
KILL_AFTER = 8
"""Kill the leader once its decisions have given GPUs to this many jobs of the burst."""
NODES = 10
"""8 GPUs each: every job of the burst (1 GPU) fits, so the last decision names them all."""


def one_gpu_job(job_id: str) -> ev.JobSubmitted:
    spec = ev.JobSpec(user="alice", min_gpus=1, max_gpus=1, requested_gpus=1, total_iterations=1000)
    return ev.JobSubmitted(job_id=job_id, spec=spec)


async def test_killed_allocator_is_replaced_by_the_standby_within_the_lease_ttl(
    bus: Bus, nats_url: str, prefix: str, children: Children, tmp_path: Path
) -> None:
    await bus.publish_many(
        [
            ev.NodeRegistered(
                node_id=f"n{i}", gpus=tuple(ev.GpuInfo(index=g, gpu_type="V100") for g in range(8))
            )
            for i in range(NODES)
        ]
    )
    clock = WallClock()
    # Same policy and inputs as the standby below; no heartbeats here, so no node timeout.
    leader = children.start(
        "allocator",
        "allocator",
        service_env(
            nats_url,
            prefix,
            clock,
            tmp_path / "state",
            policy="fifo",
            lease_ttl_s=repr(LEASE_TTL_S),
            node_timeout_s="3600",
        ),
    )
    lease = await bus.lease("allocator", "observer", ttl_s=LEASE_TTL_S)
    leader_holder = f"allocator-{default_node_id()}-{leader.pid}"

    async def holder_is(name: str) -> bool:
        return await lease.holder_now() == name

    deadline = time.monotonic() + 30
    while not await holder_is(leader_holder):
        assert leader.poll() is None, children.log("allocator")
        assert time.monotonic() < deadline, "the allocator process never took the lease"
        await asyncio.sleep(0.05)

    stop = asyncio.Event()
    standby = AllocatorService(
        bus, FIFO(), holder="standby", clock=clock, lease_ttl_s=LEASE_TTL_S, node_timeout_s=3600.0
    )
    task = asyncio.create_task(standby.run(stop))
    state = standby.projection.state
    published: list[tuple[float, str]] = []
    killed = asyncio.Event()

    async def burst() -> None:
        for i in range(BURST):
            # A steady stream; on a slow machine it waits at two points, so that some
            # jobs certainly arrive after the kill and some after the takeover.
            if i == 3 * KILL_AFTER:
                await asyncio.wait_for(killed.wait(), 60)
            if i == BURST - 15:
                await wait_until(lambda: standby.is_leader, timeout=60)
            await bus.publish(codec.wrap(one_gpu_job(f"j{i:02d}"), at=clock.now()))
            published.append((time.monotonic(), f"j{i:02d}"))
            await asyncio.sleep(0.03)

    burster = asyncio.create_task(burst())
    try:
        # The subprocess leads and has decided on part of the burst.
        await wait_until(lambda: len(standby.projection.state.shares) >= KILL_AFTER, timeout=30)
        state = standby.projection.state
        assert not standby.is_leader
        assert await holder_is(leader_holder)
        leader.send_signal(signal.SIGKILL)
        killed_at = time.monotonic()
        killed.set()
        leader.wait(timeout=10)
        await wait_until(lambda: standby.is_leader, timeout=LEASE_TTL_S + 20)
        takeover_s = time.monotonic() - killed_at
        await asyncio.wait_for(burster, 60)
        await wait_until(lambda: len(state.shares) == BURST, timeout=30)
        # Nothing else will be published: catch up with the whole log before stopping.
        await standby.projection.wait_for(await bus.last_seq(), timeout_s=30)
        assert await holder_is("standby")
    finally:
        burster.cancel()
        await asyncio.gather(burster, return_exceptions=True)
        await stop_services(stop, [task])

    assert takeover_s <= LEASE_TTL_S + TAKEOVER_SLACK_S, f"takeover took {takeover_s:.2f} s"
    before = [j for t, j in published if t < killed_at]
    assert len(published) == BURST
    assert 0 < len(before) < BURST, "the leader died in the middle of the burst"

    decisions: list[ev.SharesDecided] = await events_of(bus, ev.SharesDecided)
    epochs = [d.epoch for d in decisions]
    assert len(set(epochs)) == len(epochs), f"an epoch was decided twice: {epochs}"
    assert epochs == list(range(1, len(decisions) + 1)), "epochs strictly increase by one"
    # Both leaders decided: the dead one from the start, the standby after it took over.
    # (The standby's: at least one at the takeover and one for the jobs arriving later.)
    assert standby.decided >= 2 and len(decisions) - standby.decided >= 2
    # FIFO without preemption: a share once given is never lost, and no two successive
    # decisions say the same thing (a repeated decision is a duplicate).
    for prev, nxt in itertools.pairwise(decisions):
        assert prev.shares.items() <= nxt.shares.items()
        assert (prev.shares, prev.gpu_types) != (nxt.shares, nxt.gpu_types)
    assert decisions[-1].shares == {f"j{i:02d}": 1 for i in range(BURST)}
    # The new leader's state is the log's.
    folded, _ = await fold_log(bus, st.ClusterState(), st.apply)
    assert folded.shares_epoch == len(decisions)
    assert st.digest(folded) == st.digest(standby.projection.state)
