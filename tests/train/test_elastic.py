"""Elastic training with real worker processes and gloo: resizes, orders, storms, failures.

Every test runs the example CNN on scikit-learn's digits through a real
:class:`~shoal.train.controller.Controller` and checks what the workers actually
did from their step traces.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import os
import signal
import sys
from collections import defaultdict
from pathlib import Path

import numpy as np
import pytest
from shoal import events as ev
from shoal.train.config import TrainConfig

from tests.scripts import load_script
from tests.train.conftest import CNN, Recorder, gpus, order, processes_of, read_trace, wait_steps

pytestmark = pytest.mark.integration

DIGITS = 1797


def _load_example():
    return load_script(CNN, "cnn_digits")


def _steps(rows: list[dict]) -> dict[int, list[dict]]:
    by_step: dict[int, list[dict]] = defaultdict(list)
    for r in rows:
        by_step[r["step"]].append(r)
    return by_step


def _global_batches(rows: list[dict]) -> list[tuple[int, int, np.ndarray, dict]]:
    """(step, world, global batch in rank order, rank-0 row) for every step, checked complete."""
    out = []
    by_step = _steps(rows)
    assert sorted(by_step) == list(range(len(by_step))), "steps are contiguous from 0"
    for step in sorted(by_step):
        parts = sorted(by_step[step], key=lambda r: r["rank"])
        world = parts[0]["world"]
        assert [p["rank"] for p in parts] == list(range(world)), f"step {step}: every rank ran it once"
        assert {p["data_epoch"] for p in parts} == {parts[0]["data_epoch"]}
        batch = np.concatenate([np.asarray(p["indices"], dtype=np.int64) for p in parts])
        out.append((step, world, batch, parts[0]))
    return out


async def test_resize_1_2_4_2_1_is_exact(make_controller, job_id: str, tmp_path: Path) -> None:
    trace = tmp_path / "trace"
    rec = Recorder()
    ctl = make_controller(
        emit=rec,
        train=TrainConfig(
            collective_timeout_s=10, rendezvous_timeout_s=60, trace_dir=str(trace), trace_params_every=7
        ),
    )
    await ctl.start()
    for epoch, n in enumerate([1, 2, 4, 2, 1], start=1):
        assert await ctl.apply(order(job_id, epoch, n)) == "started"
        await ctl.wait_idle(120)
        assert ctl.current is not None and ctl.current.gpus == gpus(n)
        if epoch == 2:
            # A stale order (an older epoch) changes nothing.
            assert await ctl.apply(order(job_id, 1, 4)) == "stale"
            assert ctl.inflight is None and len(ctl.current.members) == 2
        await wait_steps(ctl, 25)
    await ctl.close(checkpoint=False)

    started = rec.of(ev.ReconfigurationStarted)
    assert [s.kind for s in started] == ["start", "scale_out", "scale_out", "scale_in", "scale_in"]
    assert [c.world_size for c in rec.of(ev.ReconfigurationCompleted)] == [1, 2, 4, 2, 1]
    assert not rec.of(ev.ReconfigurationFailed)

    batches = _global_batches(read_trace(trace))
    assert {w for _, w, _, _ in batches} == {1, 2, 4}
    # Exactly once per data epoch, whatever the resizes (EDL §4.3).
    per_epoch: dict[int, list[np.ndarray]] = defaultdict(list)
    for _, _, batch, row in batches:
        per_epoch[row["data_epoch"]].append(batch)
    finished = sorted(per_epoch)[:-1]
    assert len(finished) >= 3
    for e in finished:
        seen = np.sort(np.concatenate(per_epoch[e]))
        assert np.array_equal(seen, np.arange(DIGITS)), f"data epoch {e}: each sample exactly once"
    # Strong scaling: the global batch is 64 at every world size; only an epoch's tail is shorter.
    for (step, _, batch, row), nxt in zip(batches, [*batches[1:], None], strict=True):
        if len(batch) != 64:
            assert nxt is None or nxt[3]["data_epoch"] == row["data_epoch"] + 1, f"short batch at step {step}"
    assert sum(len(b) != 64 for _, _, b, _ in batches) <= len(per_epoch)

    # The loss keeps decreasing across the resizes.
    losses = {e: np.mean([r["loss"] for _, _, _, r in batches if r["data_epoch"] == e]) for e in finished}
    first = [losses[e] for e in finished[:4]]
    assert all(a > b for a, b in itertools.pairwise(first)), first
    switches = [s for (s, w, _, _), (_, w2, _, _) in itertools.pairwise(batches) if w != w2]
    assert len(switches) == 4
    loss_at = [r["loss"] for _, _, _, r in batches]
    for s in switches:
        before, after = np.mean(loss_at[max(0, s - 10) : s + 1]), np.mean(loss_at[s + 1 : s + 11])
        assert after <= 2 * before + 0.01, f"loss jumped at the switch after step {s}: {before} -> {after}"
        assert after < 0.5 * np.mean(loss_at[:10])

    # Each update equals what one process computes on the same global batch.
    mod = _load_example()
    import torch
    import torch.nn.functional as F

    torch.set_num_threads(1)
    x, y = mod.load_digits(torch.float64)
    model, opt = mod.build(0, torch.float64, "sgd", 0.05)
    compared = 0
    for step, _, batch, row in batches:
        idx = torch.as_tensor(batch)
        loss = F.cross_entropy(model(x[idx]), y[idx])
        opt.zero_grad()
        loss.backward()
        opt.step()
        assert abs(loss.item() - row["loss"]) <= 1e-9 * max(1.0, abs(loss.item())), f"loss at step {step}"
        if "params_after" in row:
            flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()]).numpy()
            np.testing.assert_allclose(
                row["params_after"], flat, rtol=1e-8, atol=1e-10, err_msg=f"step {step}"
            )
            compared += 1
    assert compared >= 10
    # The recorded parameters include the steps right before each switch.
    recorded = {s for s, _, _, r in batches if "params_after" in r}
    assert all(s in recorded for s in switches)


async def test_malformed_orders_get_a_clear_error(make_controller, job_id: str) -> None:
    rec = Recorder()
    ctl = make_controller(emit=rec, max_gpus=2)
    await ctl.start()
    too_many = ev.Reconfigure(job_id=job_id, epoch=1, gpus=gpus(3))
    assert await ctl.apply(too_many) == "rejected"
    unknown = ev.Reconfigure(job_id=job_id, epoch=2, gpus=(ev.GpuRef("n0", 0), ev.GpuRef("n0", 9)))
    assert await ctl.apply(unknown) == "rejected"
    other = ev.Reconfigure(job_id="someone-else", epoch=3, gpus=gpus(1))
    assert await ctl.apply(other) == "rejected"
    twice = ev.Reconfigure(job_id=job_id, epoch=4, gpus=(ev.GpuRef("n0", 1), ev.GpuRef("n0", 1)))
    assert await ctl.apply(twice) == "rejected"
    reasons = [f.reason for f in rec.of(ev.ReconfigurationFailed)]
    assert "asks for 3 GPUs" in reasons[0] and "at most 2" in reasons[0]
    assert "unknown GPU n0/9" in reasons[1]
    assert "someone-else" in reasons[2]
    assert "names a GPU twice" in reasons[3]
    # Nothing changed: no worker was started, and a rejected epoch is not "seen".
    assert ctl.current is None and not ctl.workers and not rec.of(ev.ReconfigurationStarted)
    assert ctl.epoch == -1


async def test_storm_of_20_orders_ends_in_the_last_shape(make_controller, job_id: str) -> None:
    rec = Recorder()
    ctl = make_controller(emit=rec)
    await ctl.start()
    await ctl.apply(order(job_id, 1, 2))
    await ctl.wait_idle(120)
    before = await wait_steps(ctl, 5)
    rng = np.random.default_rng(7)
    sizes = [int(s) for s in rng.integers(1, 5, size=19)] + [3]
    loop = asyncio.get_running_loop()
    taken_s = 0.0  # in apply alone (the sleeps between orders are the storm's pace)
    outcomes = []
    for epoch, n in enumerate(sizes, start=2):
        t0 = loop.time()
        outcomes.append(await ctl.apply(order(job_id, epoch, n)))
        taken_s += loop.time() - t0
        await asyncio.sleep(0.05)
    # apply never waits for a cancelled reconfiguration to wind down, so the 20 orders
    # go in within 2 s of applying (about 0.2 s on a loaded 2-core machine).
    assert taken_s < 2.0, f"20 orders took {taken_s:.2f} s to hand over"
    assert "queued" in outcomes, outcomes
    await ctl.wait_idle(120)
    assert ctl.current is not None and ctl.current.gpus == gpus(3)
    after = await wait_steps(ctl, 10)
    assert after > before, "no progress was lost"
    assert ctl.progress is not None and ctl.progress.world == 3
    cancelled = rec.of(ev.ReconfigurationCancelled)
    assert cancelled, "in-flight reconfigurations were cancelled"
    assert all(c.by_epoch > c.epoch for c in cancelled)
    done = rec.of(ev.ReconfigurationCompleted)
    assert done[-1].epoch == 21 and done[-1].world_size == 3
    # Every order that started ended exactly one way.
    ends = [
        e.epoch
        for e in rec.events
        if isinstance(e, ev.ReconfigurationCompleted | ev.ReconfigurationCancelled)
    ]
    ends += [e.epoch for e in rec.of(ev.ReconfigurationFailed)]
    assert sorted(ends) == sorted(s.epoch for s in rec.of(ev.ReconfigurationStarted))
    assert len(processes_of(job_id)) == 3, "only the last shape's workers are alive"


async def test_worker_kill9_recovers_from_checkpoint(make_controller, job_id: str) -> None:
    rec = Recorder()
    ctl = make_controller(
        emit=rec, train=TrainConfig(collective_timeout_s=10, rendezvous_timeout_s=60, checkpoint_every=20)
    )
    await ctl.start()
    await ctl.apply(order(job_id, 1, 2))
    await ctl.wait_idle(120)
    await wait_steps(ctl, 45)
    assert ctl.current is not None
    victim = ctl.workers[ctl.current.members[1]]
    os.kill(victim.proc.pid, signal.SIGKILL)
    # The order still gives the job both GPUs, and the dead worker's GPU is healthy as far
    # as anyone knows: the job restarts from its checkpoint on both (TorchElastic's restart).
    await rec.wait_for(
        lambda: any(c.epoch == 1 and c.world_size == 2 for c in rec.of(ev.ReconfigurationCompleted)[1:]), 120
    )
    assert [(s.kind, s.epoch, s.from_world, s.to_world) for s in rec.of(ev.ReconfigurationStarted)] == [
        ("start", 1, 0, 2),
        ("recover", 1, 2, 2),
    ]
    resumed = ctl.progress.step if ctl.progress else 0
    after = await wait_steps(ctl, 10)
    assert after > resumed >= 20, "training resumed from a checkpoint, not from scratch"
    assert ctl.current is not None and ctl.current.gpus == gpus(2)
    # A second death on that GPU shrinks the job by it (EDL's forced scale-in) until the
    # next order.
    victim = ctl.workers[ctl.current.members[1]]
    os.kill(victim.proc.pid, signal.SIGKILL)
    await rec.wait_for(lambda: any(c.world_size == 1 for c in rec.of(ev.ReconfigurationCompleted)), 120)
    await wait_steps(ctl, 5)
    assert [(s.kind, s.from_world, s.to_world) for s in rec.of(ev.ReconfigurationStarted)][1:] == [
        ("recover", 2, 2),
        ("recover", 2, 1),
    ]
    assert ctl.current is not None and ctl.current.gpus == gpus(1) and ctl.restarts == 2
    # A new order gives the GPU back.
    await ctl.apply(order(job_id, 2, 2))
    await ctl.wait_idle(120)
    assert ctl.current is not None and ctl.current.gpus == gpus(2)


async def test_worker_kill9_approximate_recovery_regroups_in_place(make_controller, job_id: str) -> None:
    """recovery=approximate: the survivors re-form a group and go on; nobody restarts."""
    rec = Recorder()
    train = TrainConfig(
        collective_timeout_s=10, rendezvous_timeout_s=60, checkpoint_every=0, recovery="approximate"
    )
    ctl = make_controller(emit=rec, train=train)
    await ctl.start()
    await ctl.apply(order(job_id, 1, 3))
    await ctl.wait_idle(120)
    before = await wait_steps(ctl, 20)
    assert ctl.current is not None
    survivors = {ctl.workers[m].proc.pid for m in ctl.current.members[:2]}
    os.kill(ctl.workers[ctl.current.members[2]].proc.pid, signal.SIGKILL)
    await rec.wait_for(lambda: any(c.world_size == 2 for c in rec.of(ev.ReconfigurationCompleted)), 90)
    assert survivors <= set(processes_of(job_id)), "the survivors kept running; nothing restarted"
    # ... and the order's third GPU is given back to the job (a scale-out: they keep running).
    await rec.wait_for(lambda: rec.of(ev.ReconfigurationCompleted)[-1].world_size == 3, 90)
    assert [s.kind for s in rec.of(ev.ReconfigurationStarted)] == ["start", "recover", "scale_out"]
    after = await wait_steps(ctl, 10)
    assert after > before, "training went on from where it was (no checkpoint to go back to)"
    assert survivors < set(processes_of(job_id)), "the survivors still run, with the new worker"


async def test_checkpoint_restart_for_scripts_without_the_api(
    make_controller, job_id: str, tmp_path: Path
) -> None:
    """api=False: each change is SIGTERM -> checkpoint -> restart with torchrun's variables."""
    rec = Recorder()
    argv = [sys.executable, str(CNN), "--max-steps", "1000000"]
    ctl = make_controller(emit=rec, argv=argv, api=False)
    await ctl.start()
    await ctl.apply(order(job_id, 1, 1))
    await ctl.wait_idle(60)
    checkpoint = tmp_path / "work" / "checkpoint" / "checkpoint.pt"
    first_log = tmp_path / "work" / "logs" / "worker-0.log"
    await rec.wait_for(lambda: first_log.exists() and "step 20 " in first_log.read_text(), 60)
    await ctl.apply(order(job_id, 2, 2))
    await ctl.wait_idle(60)
    assert checkpoint.exists(), "the signal made the script checkpoint"
    assert [s.kind for s in rec.of(ev.ReconfigurationStarted)] == ["start", "restart"]
    assert rec.of(ev.ReconfigurationCompleted)[-1].world_size == 2
    logs = tmp_path / "work" / "logs"

    def restored() -> bool:
        return any("restored step" in f.read_text() for f in logs.glob("worker-*.log") if f != first_log)

    await rec.wait_for(restored, 60)  # the restarted workers restored the checkpoint
    assert len(processes_of(job_id)) == 2


async def test_a_hung_worker_is_detected_within_the_collective_timeout(make_controller, job_id: str) -> None:
    """A worker that stops answering (SIGSTOP: alive, socket open, silent) must not block its
    peers forever: the collective times out after ``collective_timeout_s`` (not NCCL's
    30-minute default), the job is recovered from its checkpoint (on both GPUs: a GPU
    whose worker died once is kept for the job), and the hung process is not left behind."""
    rec = Recorder()
    timeout_s = 5.0
    ctl = make_controller(
        emit=rec,
        train=TrainConfig(collective_timeout_s=timeout_s, rendezvous_timeout_s=60, checkpoint_every=20),
    )
    await ctl.start()
    await ctl.apply(order(job_id, 1, 2))
    await ctl.wait_idle(120)
    await wait_steps(ctl, 45)
    assert ctl.current is not None
    victim = ctl.workers[ctl.current.members[1]].proc.pid
    os.kill(victim, signal.SIGSTOP)
    try:
        hung_at = asyncio.get_running_loop().time()
        await rec.wait_for(lambda: any(s.kind == "recover" for s in rec.of(ev.ReconfigurationStarted)), 120)
        detected_s = asyncio.get_running_loop().time() - hung_at
        await rec.wait_for(lambda: len(rec.of(ev.ReconfigurationCompleted)) == 2, 120)
        (recover,) = [s for s in rec.of(ev.ReconfigurationStarted) if s.kind == "recover"]
        assert (recover.from_world, recover.to_world) == (2, 2)
        assert rec.of(ev.ReconfigurationCompleted)[-1].world_size == 2
        resumed = ctl.progress.step if ctl.progress else 0
        after = await wait_steps(ctl, 10)
        assert after > resumed >= 20, "training resumed from a checkpoint"
        # Detection is bounded by the collective timeout plus the time to notice the failure.
        assert detected_s < timeout_s + 20, f"hang detected after {detected_s:.1f}s"
        assert victim not in processes_of(job_id), "the hung worker was stopped"
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(victim, signal.SIGCONT)
            os.kill(victim, signal.SIGKILL)


async def test_weak_scaling_keeps_the_per_worker_batch_across_a_resize(
    make_controller, job_id: str, tmp_path: Path
) -> None:
    """``--scaling weak``: each worker takes 16 samples whatever the world size (within
    1..4), so the global batch follows the resize 1 -> 2 -> 1; still each sample once per epoch."""
    trace = tmp_path / "trace"
    argv = [sys.executable, str(CNN), "--max-steps", "1000000", "--float64", "--scaling", "weak"]
    argv += ["--per-worker-batch", "16", "--weak-range", "1,4"]
    ctl = make_controller(
        argv=argv, train=TrainConfig(collective_timeout_s=10, rendezvous_timeout_s=60, trace_dir=str(trace))
    )
    await ctl.start()
    for epoch, n in enumerate([1, 2, 1], start=1):
        assert await ctl.apply(order(job_id, epoch, n)) == "started"
        await ctl.wait_idle(120)
        await wait_steps(ctl, 60)
    await ctl.close(checkpoint=False)
    batches = _global_batches(read_trace(trace))
    assert {w for _, w, _, _ in batches} == {1, 2}
    per_epoch: dict[int, list[np.ndarray]] = defaultdict(list)
    for (_, world, batch, row), nxt in zip(batches, [*batches[1:], None], strict=True):
        per_epoch[row["data_epoch"]].append(batch)
        if nxt is not None and nxt[3]["data_epoch"] == row["data_epoch"]:  # not an epoch's tail
            assert len(batch) == 16 * world
    finished = sorted(per_epoch)[:-1]
    assert finished, "at least one whole data epoch"
    for e in finished:
        seen = np.sort(np.concatenate(per_epoch[e]))
        assert np.array_equal(seen, np.arange(DIGITS)), f"data epoch {e}: each sample exactly once"
