"""The real trainer sidecar over a real nats-server: orders on stdin, events on the bus,
leader election in JetStream KV."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import msgspec
import pytest
from shoal import codec
from shoal import events as ev
from shoal.bus import Bus

from tests.services.test_allocator_placer import events_of
from tests.train.conftest import CNN, cnn_spec, gpus, processes_of, real_sidecar_settings

# Each test starts sidecars, workers and torch imports: 15-35 s each on two cores.
pytestmark = pytest.mark.integration


async def submit(bus: Bus, job_id: str, max_steps: int = 1_000_000, max_gpus: int = 2) -> None:
    spec = ev.JobSpec(
        user="u",
        max_gpus=max_gpus,
        global_batch_size=64,
        entrypoint=(sys.executable, str(CNN), "--max-steps", str(max_steps)),
    )
    await bus.publish(codec.wrap(ev.JobSubmitted(job_id=job_id, spec=spec), at=time.time()))


def start_sidecar(bus: Bus, nats_url: str, job_id: str, workdir: Path, *extra: str) -> subprocess.Popen:
    argv = [
        sys.executable, "-m", "shoal_services.trainer_sidecar", "--mode", "real",
        "--job", job_id, "--node", "n0", "--nats-url", nats_url, "--prefix", bus.names.prefix,
        "--devices", "2", "--workdir", str(workdir), "--report-every", "0.2",
        "--collective-timeout", "10", "--rendezvous-timeout", "60", *extra,
    ]  # fmt: skip
    env = {**os.environ, "SHOAL_TRAIN_JOB": job_id}
    return subprocess.Popen(argv, stdin=subprocess.PIPE, env=env)


def send(proc: subprocess.Popen, line: bytes) -> None:
    assert proc.stdin is not None
    proc.stdin.write(line + b"\n")
    proc.stdin.flush()


def order_line(job_id: str, epoch: int, refs: tuple[ev.GpuRef, ...]) -> bytes:
    return codec.to_json(ev.Reconfigure(job_id=job_id, epoch=epoch, gpus=refs))


async def wait_event(bus: Bus, cls: type, pred, timeout: float = 90.0, count: int = 1):
    deadline = time.monotonic() + timeout
    while True:
        found = [e for e in await events_of(bus, cls) if pred(e)]
        if len(found) >= count:
            return found
        assert time.monotonic() < deadline, f"no {cls.__name__} matching in {timeout}s"
        await asyncio.sleep(0.2)


def stop(proc: subprocess.Popen, timeout: float = 30.0) -> int:
    with contextlib.suppress(Exception):
        assert proc.stdin is not None
        proc.stdin.close()
    try:
        return proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        raise


async def test_sidecar_runs_orders_and_reports_on_the_bus(
    bus: Bus, nats_url: str, job_id: str, tmp_path: Path
) -> None:
    await submit(bus, job_id)
    side = start_sidecar(bus, nats_url, job_id, tmp_path)
    try:
        send(side, b"{not json")
        send(side, order_line(job_id, 1, gpus(1)))
        await wait_event(bus, ev.ReconfigurationCompleted, lambda e: e.epoch == 1 and e.world_size == 1)
        send(side, order_line(job_id, 2, (ev.GpuRef("n0", 0), ev.GpuRef("n0", 7))))
        failed = await wait_event(bus, ev.ReconfigurationFailed, lambda e: e.epoch == 2)
        assert "unknown GPU n0/7" in failed[0].reason
        send(side, order_line(job_id, 3, gpus(2)))
        await wait_event(bus, ev.ReconfigurationCompleted, lambda e: e.epoch == 3 and e.world_size == 2)
        send(side, order_line(job_id, 2, gpus(1)))  # stale: ignored
        progress = await wait_event(bus, ev.ProgressReported, lambda e: e.num_gpus == 2 and e.epoch == 3)
        assert (
            progress[-1].samples_per_s > 0 and progress[-1].step_time_s > 0 and progress[-1].gpu_type == "cpu"
        )
    finally:
        rc = stop(side)
    assert rc == 0
    started = await events_of(bus, ev.ReconfigurationStarted)
    assert [(s.epoch, s.kind) for s in started] == [(1, "start"), (3, "scale_out")]
    # A graceful exit checkpoints and hands the job metadata over in KV.
    kv = await bus.js.key_value(f"{bus.names.lease_bucket}_TRAIN_META")
    meta = msgspec.json.decode((await kv.get(f"train.{job_id}")).value)
    assert meta["step"] > 0 and Path(meta["checkpoint_dir"], "checkpoint.pt").exists()
    assert not processes_of(job_id)


async def test_leader_kill9_reelects_and_the_job_continues(
    bus: Bus, nats_url: str, job_id: str, tmp_path: Path
) -> None:
    await submit(bus, job_id)
    extra = ("--lease-ttl", "1.5", "--checkpoint-every", "20")
    sides = [start_sidecar(bus, nats_url, job_id, tmp_path, *extra) for _ in range(2)]
    try:
        for s in sides:
            send(s, order_line(job_id, 1, gpus(2)))
        await wait_event(bus, ev.ReconfigurationCompleted, lambda e: e.epoch == 1)
        await wait_event(bus, ev.ProgressReported, lambda e: e.iteration >= 60)
        lease_kv = await bus.js.key_value(bus.names.lease_bucket)
        holder = (await lease_kv.get(f"train.{job_id}")).value.decode()
        leader = next(s for s in sides if holder.endswith(f"-{s.pid}"))
        follower = next(s for s in sides if s is not leader)
        killed_at = max(e.iteration for e in await events_of(bus, ev.ProgressReported))
        os.kill(leader.pid, signal.SIGKILL)
        leader.wait(10)
        # The follower takes the lease after the TTL and restarts from the checkpoint.
        await wait_event(bus, ev.ReconfigurationStarted, lambda e: e.kind == "start", timeout=90, count=2)
        await wait_event(bus, ev.ProgressReported, lambda e: e.iteration > killed_at + 20, timeout=90)
        assert (await lease_kv.get(f"train.{job_id}")).value.decode().endswith(f"-{follower.pid}")
    finally:
        for s in sides:
            if s.poll() is None:
                assert stop(s) == 0
    assert not processes_of(job_id)


async def test_node_daemon_runs_a_real_job_under_the_allocator(
    bus: Bus, nats_url: str, job_id: str, tmp_path: Path
) -> None:
    """Real mode end to end, as ``shoal run node-daemon`` with ``SHOAL_SIDECAR_MODE=real``
    starts it: allocator (max-min) -> placer -> node daemon -> real sidecar -> workers.

    The allocator resizes the running job: a second job arrives and takes one of the two
    GPUs (graceful scale-in), then completes and gives it back (stop-free scale-out).
    """
    from shoal.clock import ScaledClock
    from shoal.gpus import fake_gpus
    from shoal.policies.maxmin import MaxMin
    from shoal_services.allocator.service import AllocatorService
    from shoal_services.node_daemon.main import sidecar_argv
    from shoal_services.node_daemon.service import NodeDaemon
    from shoal_services.placer.service import PlacerService

    from tests.services.test_allocator_placer import wait_until

    settings = real_sidecar_settings(bus.names.prefix, tmp_path)
    gpus = fake_gpus(2)
    clock = ScaledClock(1.0)
    stop_services = asyncio.Event()
    daemon = NodeDaemon(
        bus,
        "n0",
        gpus,
        clock=clock,
        sidecar_argv=sidecar_argv("n0", settings, gpus, True, nats_url),
        heartbeat_s=0.2,
    )
    services = [
        AllocatorService(bus, MaxMin(), holder="a", clock=clock, node_timeout_s=None),
        PlacerService(bus, holder="p", clock=clock),
        daemon,
    ]
    os.environ["SHOAL_TRAIN_JOB"] = job_id  # the sidecars and their workers carry the job id
    other = f"{job_id}-b"
    tasks = [asyncio.create_task(s.run(stop_services)) for s in services]

    def status(jid: str) -> str:
        job = daemon.projection.state.jobs.get(jid)
        return job.status if job else ""

    async def world_of(jid: str, kind: str) -> list[int]:
        return [
            s.to_world
            for s in await events_of(bus, ev.ReconfigurationStarted)
            if s.job_id == jid and s.kind == kind
        ]

    try:
        await wait_until(lambda: "n0" in daemon.projection.state.nodes)
        await bus.publish(
            codec.wrap(ev.JobSubmitted(job_id=job_id, spec=cnn_spec(1_000_000, 2)), at=clock.now())
        )
        await wait_event(bus, ev.ProgressReported, lambda p: p.job_id == job_id and p.num_gpus == 2)
        await bus.publish(codec.wrap(ev.JobSubmitted(job_id=other, spec=cnn_spec(60, 1)), at=clock.now()))
        await wait_until(lambda: status(other) == "completed", timeout=120)
        # The start at two workers, then the scale-out back to two once the GPU is free.
        await wait_event(
            bus, ev.ReconfigurationCompleted, lambda c: c.job_id == job_id and c.world_size == 2, count=2
        )
        assert 1 in await world_of(job_id, "scale_in")
        assert 2 in await world_of(job_id, "scale_out")
        await bus.publish(codec.wrap(ev.JobCancelled(job_id=job_id, reason="test over"), at=clock.now()))
        await wait_until(lambda: not daemon.sidecars, timeout=60)
    finally:
        del os.environ["SHOAL_TRAIN_JOB"]
        stop_services.set()
        await asyncio.wait_for(asyncio.gather(*tasks), 30)
    done = await events_of(bus, ev.JobCompleted)
    assert [(d.job_id, d.iterations) for d in done] == [(other, 60)]
    completed = await events_of(bus, ev.ReconfigurationCompleted)
    assert [c.world_size for c in completed if c.job_id == job_id][:3] == [2, 1, 2]
