"""One job on two nodes in real mode: one sidecar per job per node, workers on the nodes
the placement names, over a real nats-server.

The two "nodes" share this machine: each is a real sidecar process started as the node
daemon starts it (``--mode real --node nX``), fed orders on stdin. The leader starts
the worker of the other node through that node's sidecar, which runs it as its own child.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path

import pytest
from shoal import codec
from shoal import events as ev
from shoal.bus import Bus
from shoal.gpus import fake_gpus

from tests.services.test_allocator_placer import events_of
from tests.train.conftest import CNN, cnn_spec, processes_of, real_sidecar_settings
from tests.train.test_sidecar import order_line, send, stop, wait_event

# Two sidecars, their workers and the torch imports of all of them: 30-50 s each on two cores.
pytestmark = pytest.mark.integration

N0, N1 = ev.GpuRef("n0", 0), ev.GpuRef("n1", 0)
LEASE_TTL_S = 1.5


async def setup_job(bus: Bus, job_id: str, trace: Path) -> None:
    """Two registered nodes with one (fake) GPU each, and a job that may use both."""
    for node in ("n0", "n1"):
        await bus.publish(
            codec.wrap(ev.NodeRegistered(node_id=node, gpus=fake_gpus(1), emulated=True), at=time.time())
        )
    spec = ev.JobSpec(
        user="u",
        max_gpus=2,
        global_batch_size=64,
        entrypoint=(sys.executable, str(CNN), "--max-steps", "1000000"),
        env={"SHOAL_TRAIN_TRACE_DIR": str(trace), "SHOAL_TRAIN_CHECKPOINT_EVERY": "20"},
    )
    await bus.publish(codec.wrap(ev.JobSubmitted(job_id=job_id, spec=spec), at=time.time()))


def start_node_sidecar(bus: Bus, nats_url: str, job_id: str, node: str, workdir: Path) -> subprocess.Popen:
    argv = [
        sys.executable, "-m", "shoal_services.trainer_sidecar", "--mode", "real",
        "--job", job_id, "--node", node, "--nats-url", nats_url, "--prefix", bus.names.prefix,
        "--devices", "1", "--workdir", str(workdir), "--report-every", "0.2",
        "--collective-timeout", "10", "--rendezvous-timeout", "60", "--lease-ttl", repr(LEASE_TTL_S),
        "--advertise-host", "127.0.0.1",
    ]  # fmt: skip
    return subprocess.Popen(argv, stdin=subprocess.PIPE, env={**os.environ, "SHOAL_TRAIN_JOB": job_id})


async def lease_holder(bus: Bus, job_id: str) -> str:
    with contextlib.suppress(Exception):  # no bucket or no key yet: nobody leads
        kv = await bus.js.key_value(bus.names.lease_bucket)
        return (await kv.get(f"train.{job_id}")).value.decode()
    return ""


async def wait_leader(bus: Bus, job_id: str, side: subprocess.Popen, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not (await lease_holder(bus, job_id)).endswith(f"-{side.pid}"):
        assert side.poll() is None, "the sidecar exited"
        assert time.monotonic() < deadline, "the first sidecar did not take the lease"
        await asyncio.sleep(0.1)


async def leader_and_follower(
    bus: Bus, nats_url: str, job_id: str, workdir: Path, sides: list[subprocess.Popen]
) -> tuple[subprocess.Popen, subprocess.Popen]:
    """The job's sidecar on n0, once it leads, then one on n1; both are added to
    ``sides`` as they start (the caller stops them)."""
    s0 = start_node_sidecar(bus, nats_url, job_id, "n0", workdir)
    sides.append(s0)
    await wait_leader(bus, job_id, s0)
    s1 = start_node_sidecar(bus, nats_url, job_id, "n1", workdir)
    sides.append(s1)
    return s0, s1


def stop_all(sides: list[subprocess.Popen]) -> list[int]:
    """End of stdin for every sidecar at once, as the node daemons do when the job ends."""
    for s in sides:
        with contextlib.suppress(OSError):
            assert s.stdin is not None
            s.stdin.close()
    return [s.returncode if s.returncode is not None else stop(s) for s in sides]


class Parents:
    """Samples the parent of every live process of the job: whose child each worker is."""

    def __init__(self, job_id: str) -> None:
        self.job_id = job_id
        self.of: dict[int, int] = {}
        self._task: asyncio.Task[None] | None = None

    def _sample(self) -> None:
        for pid in processes_of(self.job_id):
            with contextlib.suppress(OSError), open(f"/proc/{pid}/stat") as f:
                self.of.setdefault(pid, int(f.read().rsplit(")", 1)[1].split()[1]))

    async def _run(self) -> None:
        while True:
            await asyncio.to_thread(self._sample)
            await asyncio.sleep(0.1)

    def __enter__(self) -> Parents:
        self._task = asyncio.create_task(self._run())
        return self

    def __exit__(self, *exc: object) -> None:
        assert self._task is not None
        self._task.cancel()


def steps_by_gen(trace: Path) -> dict[int, dict[int, list[dict]]]:
    """gen -> step -> the rows of that step (one per worker), each with its worker's pid."""
    out: dict[int, dict[int, list[dict]]] = defaultdict(lambda: defaultdict(list))
    for f in sorted(trace.glob("steps-*.jsonl")):
        pid = int(f.stem.rsplit("-p", 1)[1])
        for line in f.read_text().splitlines():
            if line.strip():
                row = {**json.loads(line), "pid": pid}
                out[row["gen"]][row["step"]].append(row)
    return out


def assert_trained_across(gens: dict[int, list[dict]], parents: dict[int, int], sidecars: set[int]) -> int:
    """Every step of a world-2 generation had one worker under each sidecar, taking disjoint
    halves of the global batch; returns how many such steps there were."""
    steps = 0
    for rows in gens.values():
        if len(rows) != 2:
            continue  # a step at a switch boundary recorded by one side only
        assert {r["world"] for r in rows} == {2} and {r["rank"] for r in rows} == {0, 1}
        assert {parents.get(r["pid"]) for r in rows} == sidecars, (rows, parents)
        a, b = (set(r["indices"]) for r in rows)
        # Halves of one global batch: 64 samples, or the 1797 % 64 left at a data epoch's tail.
        assert not a & b and abs(len(a) - len(b)) <= 1 and len(a | b) in (64, 1797 % 64)
        steps += 1
    return steps


async def test_a_job_on_two_nodes_is_resized_across_them(
    bus: Bus, nats_url: str, job_id: str, tmp_path: Path
) -> None:
    """2 nodes x 1 GPU -> the leader's node only -> 2 nodes again, as the node daemons would
    drive it: the node that loses the job gets the order and then end of stdin; the node
    that gets it back starts a fresh sidecar."""
    trace = tmp_path / "trace"
    await setup_job(bus, job_id, trace)
    sides: list[subprocess.Popen] = []
    try:
        s0, s1 = await leader_and_follower(bus, nats_url, job_id, tmp_path, sides)
        with Parents(job_id) as parents:
            for s in (s0, s1):
                send(s, order_line(job_id, 1, (N0, N1)))
            await wait_event(bus, ev.ReconfigurationCompleted, lambda e: e.epoch == 1 and e.world_size == 2)
            await wait_event(
                bus, ev.ProgressReported, lambda e: e.epoch == 1 and e.num_gpus == 2 and e.iteration >= 40
            )
            # n1 loses the job: its node daemon sends the order, then closes the sidecar's stdin.
            for s in (s0, s1):
                send(s, order_line(job_id, 2, (N0,)))
            assert stop(s1) == 0
            await wait_event(bus, ev.ReconfigurationCompleted, lambda e: e.epoch == 2 and e.world_size == 1)
            shrunk_at = (
                await wait_event(bus, ev.ProgressReported, lambda e: e.epoch == 2 and e.num_gpus == 1)
            )[-1]
            # n1 gets it back: a fresh sidecar there, the worker starts through it.
            s1b = start_node_sidecar(bus, nats_url, job_id, "n1", tmp_path)
            sides.append(s1b)
            for s in (s0, s1b):
                send(s, order_line(job_id, 3, (N0, N1)))
            await wait_event(bus, ev.ReconfigurationCompleted, lambda e: e.epoch == 3 and e.world_size == 2)
            regrown_at = max(e.iteration for e in await events_of(bus, ev.ProgressReported))
            grown = await wait_event(
                bus,
                ev.ProgressReported,
                lambda e: e.epoch == 3 and e.num_gpus == 2 and e.iteration >= regrown_at + 40,
            )
        assert (await lease_holder(bus, job_id)).endswith(f"-{s0.pid}"), "the leader never moved"
        started = [(s.epoch, s.kind) for s in await events_of(bus, ev.ReconfigurationStarted)]
        assert started == [(1, "start"), (2, "scale_in"), (3, "scale_out")], (
            "resized in place, never restarted"
        )
        assert not await events_of(bus, ev.ReconfigurationFailed)
    finally:
        assert stop_all(sides) == [0] * len(sides)
    by_gen = steps_by_gen(trace)
    two = sorted(
        g for g, steps in by_gen.items() if any(r["world"] == 2 for rows in steps.values() for r in rows)
    )
    assert len(two) == 2, f"generations at world 2: {two}"
    assert assert_trained_across(by_gen[two[0]], parents.of, {s0.pid, s1.pid}) >= 30
    assert assert_trained_across(by_gen[two[1]], parents.of, {s0.pid, s1b.pid}) >= 30
    # Progress went on across both resizes: no step was redone, none skipped.
    steps = sorted({step for gen in by_gen.values() for step in gen})
    assert steps == list(range(steps[0], steps[-1] + 1)) and steps[0] == 0
    assert grown[-1].iteration > shrunk_at.iteration
    assert not processes_of(job_id)


async def test_a_follower_that_dies_takes_its_workers_and_the_leader_recovers(
    bus: Bus, nats_url: str, job_id: str, tmp_path: Path
) -> None:
    """kill -9 of the sidecar on the leader's peer node: its worker dies with it, the leader
    sees a worker death and recovers from the checkpoint; the allocator's next order (the
    node is gone) leaves the job on the leader's node, where it keeps training."""
    trace = tmp_path / "trace"
    await setup_job(bus, job_id, trace)
    sides: list[subprocess.Popen] = []
    try:
        s0, s1 = await leader_and_follower(bus, nats_url, job_id, tmp_path, sides)
        # GPUs of another node are checked against what the node registered.
        send(s0, order_line(job_id, 1, (N0, ev.GpuRef("n1", 5))))
        send(s0, order_line(job_id, 2, (N0, ev.GpuRef("n9", 0))))
        rejected = await wait_event(bus, ev.ReconfigurationFailed, lambda e: e.epoch in (1, 2), count=2)
        assert sorted(r.reason for r in rejected) == [
            "unknown GPU n1/5: node n1 registered [0]",
            "unknown GPU n9/0: node n9 is not registered",
        ]
        with Parents(job_id) as parents:
            for s in (s0, s1):
                send(s, order_line(job_id, 3, (N0, N1)))
            await wait_event(bus, ev.ProgressReported, lambda e: e.num_gpus == 2 and e.iteration >= 30)
        remote_workers = [pid for pid, parent in parents.of.items() if parent == s1.pid]
        assert len(remote_workers) == 1
        killed_at = max(e.iteration for e in await events_of(bus, ev.ProgressReported))
        os.kill(s1.pid, signal.SIGKILL)
        s1.wait(10)
        await wait_event(bus, ev.ReconfigurationStarted, lambda e: e.kind == "recover", timeout=60)
        assert remote_workers[0] not in processes_of(job_id), "the worker died with its node's sidecar"
        # The job shrinks by the lost node's GPU, not by the healthy worker whose
        # all-reduce broke when its peer died.
        recovered = await wait_event(
            bus, ev.ReconfigurationCompleted, lambda e: e.epoch == 3 and e.world_size == 1
        )
        assert recovered[-1].gpus == (N0,)
        await wait_event(bus, ev.ProgressReported, lambda e: e.num_gpus == 1 and e.iteration > killed_at)
        # The allocator's next order (n1 is gone) keeps it there; training goes on.
        send(s0, order_line(job_id, 4, (N0,)))
        await wait_event(
            bus,
            ev.ProgressReported,
            lambda e: e.epoch == 4 and e.num_gpus == 1 and e.iteration > killed_at + 10,
        )
        assert [f.epoch for f in await events_of(bus, ev.ReconfigurationFailed)] == [1, 2]
    finally:
        assert stop_all(sides) == [0 if s is s0 else s.returncode for s in sides]
    recover = [s for s in await events_of(bus, ev.ReconfigurationStarted) if s.kind == "recover"]
    assert recover[0].from_world == 2
    # Recovery restarts from the periodic checkpoint (every 20 steps), not from scratch.
    rows = [r for steps in steps_by_gen(trace).values() for rs in steps.values() for r in rs]
    restarted = min(r["step"] for r in rows if r["gen"] > min(r2["gen"] for r2 in rows))
    assert restarted >= 20
    assert not processes_of(job_id)


async def test_node_daemons_run_a_job_across_two_nodes_under_the_allocator(
    bus: Bus, nats_url: str, job_id: str, tmp_path: Path
) -> None:
    """Real mode end to end on two nodes, as two ``shoal run node-daemon`` with
    ``SHOAL_SIDECAR_MODE=real`` run it: allocator (max-min) -> placer -> node daemons ->
    one real sidecar per node -> workers on both nodes.

    A second job takes one of the two GPUs (the first job shrinks to one node), then
    completes and gives it back (the first job spans both nodes again). Which node the
    first job keeps is the placer's choice: when it is not the leader's, the leader's
    node daemon stops it and the other sidecar takes over from the checkpoint.
    """
    from shoal.clock import ScaledClock
    from shoal.policies.maxmin import MaxMin
    from shoal_services.allocator.service import AllocatorService
    from shoal_services.node_daemon.main import sidecar_argv
    from shoal_services.node_daemon.service import NodeDaemon
    from shoal_services.placer.service import PlacerService

    from tests.services.test_allocator_placer import wait_until

    settings = real_sidecar_settings(bus.names.prefix, tmp_path)
    clock = ScaledClock(1.0)
    stop_services = asyncio.Event()
    daemons = [
        NodeDaemon(
            bus,
            node,
            fake_gpus(1),
            clock=clock,
            sidecar_argv=sidecar_argv(node, settings, fake_gpus(1), True, nats_url),
            heartbeat_s=0.2,
        )
        for node in ("n0", "n1")
    ]
    services = [
        AllocatorService(bus, MaxMin(), holder="a", clock=clock, node_timeout_s=None),
        PlacerService(bus, holder="p", clock=clock),
        *daemons,
    ]
    os.environ["SHOAL_TRAIN_JOB"] = job_id  # the sidecars and their workers carry the job id
    other = f"{job_id}-b"
    tasks = [asyncio.create_task(s.run(stop_services)) for s in services]

    def status(jid: str) -> str:
        job = daemons[0].projection.state.jobs.get(jid)
        return job.status if job else ""

    try:
        await wait_until(lambda: {"n0", "n1"} <= set(daemons[0].projection.state.nodes))
        await bus.publish(
            codec.wrap(ev.JobSubmitted(job_id=job_id, spec=cnn_spec(1_000_000, 2)), at=clock.now())
        )
        spanning = await wait_event(
            bus, ev.ReconfigurationCompleted, lambda c: c.job_id == job_id and c.world_size == 2
        )
        assert {g.node_id for g in spanning[0].gpus} == {"n0", "n1"}
        await wait_event(bus, ev.ProgressReported, lambda p: p.job_id == job_id and p.num_gpus == 2)
        await bus.publish(codec.wrap(ev.JobSubmitted(job_id=other, spec=cnn_spec(60, 1)), at=clock.now()))
        await wait_until(lambda: status(other) == "completed", timeout=120)
        # Back on both nodes once the GPU is free, and training there.
        await wait_event(
            bus, ev.ReconfigurationCompleted, lambda c: c.job_id == job_id and c.world_size == 2, count=2
        )
        back = max(p.epoch for p in await events_of(bus, ev.ProgressReported) if p.job_id == job_id)
        await wait_event(
            bus, ev.ProgressReported, lambda p: p.job_id == job_id and p.num_gpus == 2 and p.epoch >= back
        )
        await bus.publish(codec.wrap(ev.JobCancelled(job_id=job_id, reason="test over"), at=clock.now()))
        await wait_until(lambda: not any(d.sidecars for d in daemons), timeout=60)
    finally:
        del os.environ["SHOAL_TRAIN_JOB"]
        stop_services.set()
        await asyncio.wait_for(asyncio.gather(*tasks), 30)
    done = await events_of(bus, ev.JobCompleted)
    assert [(d.job_id, d.iterations) for d in done] == [(other, 60)]
    worlds = [c.world_size for c in await events_of(bus, ev.ReconfigurationCompleted) if c.job_id == job_id]
    assert worlds[0] == 2 and 1 in worlds and worlds[worlds.index(1) :].count(2) >= 1, worlds
    assert not await events_of(bus, ev.ReconfigurationFailed)


async def test_a_follower_runs_only_the_jobs_entrypoint_and_env(
    bus: Bus, nats_url: str, job_id: str, tmp_path: Path
) -> None:
    """A spawn request is what the sidecar of a job on another node (possibly taken over
    by the job's own code) sends: the follower on n1 checks it against the job's spec in
    the log. Another command, or a variable the spec does not set (``LD_PRELOAD``), is
    refused with a reason and runs nothing; the job's own command and env with the
    trainer's and torchrun's variables pass the check (and fail only later, on a GPU
    index n1 does not have)."""
    import msgspec
    from shoal.bus import Campaign
    from shoal.train.launch import LaunchRequest
    from shoal_services.trainer_sidecar.remote import SpawnReply, SpawnRequest, subject

    await setup_job(bus, job_id, tmp_path / "trace")
    # The job's leader is on another node (here: this test, as "mallory" on n0), holding
    # the job's lease all along: a sidecar with no leader would take the lease itself
    # after its TTL and then refuse every spawn as the leader.
    campaign = Campaign(await bus.lease(f"train.{job_id}", "n0-mallory", ttl_s=LEASE_TTL_S))
    assert await campaign.poll() == "elected"

    async def keep_leading() -> None:
        while True:
            await asyncio.sleep(campaign.until_due())
            await campaign.poll()

    leading = asyncio.create_task(keep_leading())
    follower = start_node_sidecar(bus, nats_url, job_id, "n1", tmp_path / "work")
    marker = tmp_path / "pwned"
    spec = (sys.executable, str(CNN), "--max-steps", "1000000")
    job_env = {"SHOAL_TRAIN_TRACE_DIR": str(tmp_path / "trace"), "SHOAL_TRAIN_CHECKPOINT_EVERY": "20"}

    async def spawn(worker: int, argv: tuple[str, ...], env: dict[str, str], index: int = 0) -> SpawnReply:
        launch = LaunchRequest(job_id=job_id, worker=worker, gpu=ev.GpuRef("n1", index), argv=argv, env=env)
        body = msgspec.json.encode(SpawnRequest(leader="mallory", request=launch))
        deadline = time.monotonic() + 60
        while True:  # the follower serves spawns once it has read the job's spec
            try:
                msg = await bus.nc.request(subject(bus.names.prefix, job_id, "n1", "spawn"), body, timeout=5)
                return msgspec.json.decode(msg.data, type=SpawnReply)
            except Exception:
                assert follower.poll() is None, "the follower exited"
                assert time.monotonic() < deadline, "the follower never answered"
                await asyncio.sleep(0.2)

    try:
        other = await spawn(1, ("sh", "-c", f"touch {marker}"), {})
        assert other.pid == 0 and "entrypoint" in other.error, other
        preload = await spawn(2, spec, {**job_env, "LD_PRELOAD": str(tmp_path / "evil.so")})
        assert preload.pid == 0 and "LD_PRELOAD" in preload.error, preload
        changed = await spawn(3, spec, {**job_env, "SHOAL_TRAIN_CHECKPOINT_EVERY": "20", "PATH": "/tmp"})
        assert changed.pid == 0 and "PATH" in changed.error, changed
        # The job's own command and env (plus the trainer's and torchrun's variables) get
        # past the check: refused only for the GPU index n1 does not have.
        own = await spawn(4, spec, {**job_env, "SHOAL_TRAIN_WORKER": "4", "RANK": "1"}, index=7)
        assert own.pid == 0 and own.error and "entrypoint" not in own.error and "variable" not in own.error
        await asyncio.sleep(0.5)
        assert not marker.exists()
        assert campaign.is_leader, "the lease left the job's leader during the test"
    finally:
        stop_all([follower])
        leading.cancel()
        await campaign.release()
